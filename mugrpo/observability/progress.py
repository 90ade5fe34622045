"""Console progress: tqdm bars for generation, optimisation and evaluation, one-line stage and
evaluation summaries.

Disabled (``enabled=False``) on ranks other than 0 and with ``train.progress=false``; the loop
calls it unconditionally either way.
"""

from __future__ import annotations

import math
import sys

_SHOWN = (("loss/policy", "loss", "{:+.4f}"), ("loss/clip_frac_low", "clip_lo", "{:.3f}"),
          ("loss/clip_frac_high", "clip_hi", "{:.3f}"), ("loss/veto_token_frac", "veto", "{:.3f}"),
          ("loss/ratio_mean_neg", "rho-", "{:.3f}"), ("optim/grad_norm", "gnorm", "{:.2f}"))


def _fmt(fmt: str, value) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


class Progress:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def bar(self, total: int, desc: str, unit: str = "upd", initial: int = 0):
        if not self.enabled:
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr, dynamic_ncols=True,
                    leave=True)

    def advance(self, bar, n: int) -> None:
        if bar is not None:
            bar.update(n)

    def update(self, bar, metrics: dict) -> None:
        if bar is None:
            return
        bar.set_postfix_str(" ".join(f"{name}={_fmt(fmt, metrics.get(key))}" for key, name, fmt in _SHOWN),
                            refresh=False)
        bar.update(1)

    def close(self, bar) -> None:
        if bar is not None:
            bar.close()

    def stage_summary(self, stage: int, m: dict) -> None:
        if not self.enabled:
            return
        parts = [f"reward {_fmt('{:.3f}', m.get('reward/mean'))}",
                 f"len {_fmt('{:.1f}', m.get('stage/response_len_mean'))}",
                 f"zero-var {_fmt('{:.2f}', m.get('stage/zero_var_group_frac'))}"]
        for key in ("perf/sync_s", "perf/generate_s", "perf/score_s", "perf/optimize_s", "perf/eval_s",
                    "perf/checkpoint_s"):
            if m.get(key) is not None:
                parts.append(f"{key.split('/')[1][:-2]} {m[key]:.1f}s")
        if m.get("perf/generate_tok_s") is not None:
            parts.append(f"gen {m['perf/generate_tok_s']:.0f} tok/s")
        if m.get("stage/num_rounds") is not None:  # dynamic sampling (mugrpo.algo.dynamic)
            parts.append(f"informative {_fmt('{:.2f}', m.get('stage/informative_frac'))} of the groups generated "
                         f"in {m['stage/num_rounds']} round(s)")
        if m.get("stage/ended_early"):
            parts.append(f"ended early ({m.get('stage/end_reason')} guard) after {m.get('stage/num_updates')} updates")
        print(f"[mugrpo] stage {stage} done: " + " | ".join(parts), file=sys.stderr, flush=True)

    def eval_summary(self, update: int, m: dict) -> None:
        """One line per evaluation: the ``eval/*`` accuracies, response length, time."""
        if not self.enabled:
            return
        scores = [f"{key.split('/')[1]} {_fmt('{:.3f}', m[key])}" for key in sorted(m)
                  if key.startswith(("eval/greedy", "eval/avg_at", "eval/pass_at"))]
        parts = scores + [f"len {_fmt('{:.1f}', m.get('eval/response_len_mean'))}",
                          f"{m.get('eval/num_items', 0)} items", f"{m.get('perf/eval_s', 0.0):.1f}s"]
        print(f"[mugrpo] eval @ update {update}: " + " | ".join(parts), file=sys.stderr, flush=True)
