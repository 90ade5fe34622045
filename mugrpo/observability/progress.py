"""Console progress: tqdm bars for generation, optimisation and evaluation, one-line stage and
evaluation summaries.

Disabled (``enabled=False``) on ranks other than 0 and with ``train.progress=false``; the loop
calls it unconditionally either way.
"""

from __future__ import annotations

import math
import sys
import time

_SHOWN = (("loss/policy", "loss", "{:+.4f}"), ("loss/clip_frac_low", "clip_lo", "{:.3f}"),
          ("loss/clip_frac_high", "clip_hi", "{:.3f}"), ("loss/veto_token_frac", "veto", "{:.3f}"),
          ("loss/ratio_mean_neg", "rho-", "{:.3f}"), ("optim/grad_norm", "gnorm", "{:.2f}"))


def _fmt(fmt: str, value) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


class Progress:
    """``enabled``: bars and summaries; ``lines``: with bars off, still print a long step's
    occasional line (:meth:`ticker`) and the warm start's line per step (False on ranks other than 0)."""

    def __init__(self, enabled: bool = True, lines: bool = True):
        self.enabled, self.lines = enabled, lines

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

    def ticker(self, total: int, desc: str, unit: str, every_s: float = 30.0) -> "Ticker":
        """Progress through ``total`` items of a long step with no other output: a bar, or with
        ``train.progress=false`` one line at most every ``every_s`` seconds (quiet on other ranks)."""
        return Ticker(self.bar(total, desc, unit=unit), total, desc, unit, every_s if self.lines else None)

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


class Ticker:
    """See :meth:`Progress.ticker`: ``advance(n)`` after each ``n`` items, ``close()`` at the end."""

    def __init__(self, bar, total: int, desc: str, unit: str, every_s: float | None):
        self.bar, self.total, self.desc, self.unit, self.every_s = bar, total, desc, unit, every_s
        self.done, self.t0 = 0, time.perf_counter()
        self._last = self.t0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.every_s is not None and now - self._last >= self.every_s and self.done < self.total:
            self._last = now
            print(f"[mugrpo] {self.desc}: {self.done} of {self.total} {self.unit}s ({now - self.t0:.0f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
