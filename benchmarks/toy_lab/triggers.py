"""Trigger tokens of the long toy lab, offline: which tokens trigger the veto, and what follows them.

The trainer logs only aggregates (trigger fraction, first trigger position). This script takes a
run folder kept by ``benchmarks.toy_lab.run --setting long`` (its last stage's rollouts with their
stored behaviour log-probs, and the final checkpoint, i.e. the policy after the stage's last
update) and recomputes every token's log-ratio log pi_theta - log pi_b with
:func:`mugrpo.kit.forward.response_logprobs`, the trainer's own forward. It then reports, for
negative-advantage responses:

- how many trigger at delta = 1e-2, 1e-3, 1e-4, and where the first trigger sits;
- what kind of character triggers: a *decisive* one (a digit of a running total or of the boxed
  answer, i.e. the result of an addition) or an *ordinary* one (a letter, a looked-up term, a copy
  of the previous total, punctuation);
- E[rho] of the tokens before the first trigger, at it, and after it (the suffix the veto drops);
- a few examples: the response with the trigger marked ``[[c]]`` and its rho.

Nothing here slows the trainer down; it reads what the run left on disk.

    PYTHONPATH=. python -m benchmarks toy_lab_triggers [KEPT_RUN_DIR ...]

Output: ``benchmarks/results/toy_lab_long_triggers.json`` and a markdown summary on stdout.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from benchmarks.suite import common_arguments, read_stage_data, write_result
from benchmarks.toy_lab.warmstart import CACHE
DELTAS = (1e-2, 1e-3, 1e-4)


def decisive_positions(text: str) -> set[int]:
    """Character positions of computed results: the digits of a sum (``7+3=10``, not the looked-up
    ``b=3``) and inside ``\\boxed{}``."""
    out = set()
    for m in re.finditer(r"\d\+\d+=(-?\d+)", text):
        out.update(range(m.start(1), m.end(1)))
    for m in re.finditer(r"\\boxed\{([^}]*)\}", text):
        out.update(range(m.start(1), m.end(1)))
    return out


@torch.no_grad()
def stage_log_ratios(run_dir: Path):
    """(StageData of the last stage, per-sequence log-ratio lists) with the run's final policy."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mugrpo.config import load_config
    from mugrpo.kit.batching import collate
    from mugrpo.kit.forward import response_logprobs

    cfg = load_config(file=run_dir / "config.yaml")
    stage = sorted((run_dir / "stages").glob("stage_*"))[-1]
    data = read_stage_data(stage)
    ckpt = sorted((run_dir / "checkpoints").glob("ckpt_*"))[-1]
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to the embedding, saved once
        raise SystemExit(f"[toy_lab] {ckpt} does not fit {cfg.model.name}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    pad = model.config.pad_token_id
    ratios = []
    for start in range(0, len(data.responses), 128):
        seqs = list(range(start, min(start + 128, len(data.responses))))
        mb = collate(data, seqs, pad)
        logprobs, _ = response_logprobs(model, mb, cfg.rollout.temperature, False, False, False)
        log_ratio = (logprobs - mb.behavior_logprobs).masked_fill(~mb.response_mask, 0.0)
        ratios += [log_ratio[i, :len(data.responses[s])].tolist() for i, s in enumerate(seqs)]
    return cfg, stage.name, ckpt.name, data, ratios


def analyse(run_dir: Path, num_examples: int = 4) -> dict:
    from mugrpo.models.loading import load_tokenizer

    cfg, stage, ckpt, data, ratios = stage_log_ratios(run_dir)
    tok = load_tokenizer(cfg.model.name)
    neg = [s for s in range(len(data.responses)) if float(data.advantages[s]) < 0]
    out = {"run_dir": str(run_dir), "stage": stage, "checkpoint": ckpt, "num_sequences": len(data.responses),
           "num_negative": len(neg), "by_delta": {}}
    for delta in DELTAS:
        log_d = math.log(delta)
        firsts, kinds, pre, at, post, examples = [], {"decisive": 0, "ordinary": 0}, [], [], [], []
        num_trig_tokens = num_tokens = 0
        for s in neg:
            lr = ratios[s]
            num_tokens += len(lr)
            trig = [t for t, v in enumerate(lr) if v < log_d]
            num_trig_tokens += len(trig)
            if not trig:
                continue
            k = trig[0]
            text = tok.decode(data.responses[s], skip_special_tokens=False)
            chars = [tok.decode([i]) for i in data.responses[s]]
            decisive = decisive_positions("".join(c if len(c) == 1 else "\x00" for c in chars))
            firsts.append(k)
            kinds["decisive" if k in decisive else "ordinary"] += 1
            pre += [math.exp(v) for v in lr[:k]]
            at.append(math.exp(lr[k]))
            post += [math.exp(max(v, -20)) for v in lr[k + 1:]]
            if len(examples) < num_examples and delta == 1e-3 and all(e["full"] != text for e in examples):
                marked = "".join(f"[[{c}]]" if t == k else c for t, c in enumerate(chars))
                examples.append({"seq": s, "advantage": round(float(data.advantages[s]), 3),
                                 "reward": float(data.rewards[s]), "first_trigger": k,
                                 "rho_at_trigger": math.exp(lr[k]), "num_after": len(lr) - k - 1,
                                 "rho_after_mean": sum(math.exp(v) for v in lr[k + 1:]) / max(len(lr) - k - 1, 1),
                                 "text": marked.replace("<eos>", ""), "full": text})
        mean = (lambda xs: sum(xs) / len(xs) if xs else None)
        out["by_delta"][f"{delta:g}"] = {
            "negative_with_trigger_frac": len(firsts) / max(len(neg), 1),
            "trigger_token_frac_of_negative_tokens": num_trig_tokens / max(num_tokens, 1),
            "first_trigger_pos_mean": mean(firsts), "first_trigger_pos_median": sorted(firsts)[len(firsts) // 2]
            if firsts else None, "first_trigger_kind": kinds,
            "rho_before_first_mean": mean(pre), "rho_at_first_mean": mean(at), "rho_after_first_mean": mean(post),
            "num_after_first": len(post), "examples": examples}
    neg_rho = [math.exp(v) for s in neg for v in ratios[s]]
    pos_rho = [math.exp(v) for s in range(len(data.responses)) if float(data.advantages[s]) > 0 for v in ratios[s]]
    out["rho_mean_negative"] = sum(neg_rho) / max(len(neg_rho), 1)
    out["rho_mean_positive"] = sum(pos_rho) / max(len(pos_rho), 1)
    out["response_len_median"] = sorted(len(r) for r in data.responses)[len(data.responses) // 2]
    return out


def markdown(results: list[dict]) -> str:
    lines = []
    for r in results:
        name = Path(r["run_dir"]).name
        lines.append(f"**{name}** ({r['stage']} rollouts, policy {r['checkpoint']}; {r['num_negative']} of "
                     f"{r['num_sequences']} responses have A < 0; median length {r['response_len_median']}; "
                     f"E[rho | A<0] {r['rho_mean_negative']:.3f}, E[rho | A>0] {r['rho_mean_positive']:.3f})\n")
        lines.append("| delta | A<0 responses with a trigger | trigger tokens / A<0 tokens | first trigger pos "
                     "(mean, median) | first trigger decisive / ordinary | E[rho] before / at / after first |")
        lines.append("|---|---|---|---|---|---|")
        for d, v in r["by_delta"].items():
            f = (lambda x: "-" if x is None else f"{x:.3g}")
            lines.append(f"| {d} | {v['negative_with_trigger_frac']:.1%} | {v['trigger_token_frac_of_negative_tokens']:.2%}"
                         f" | {f(v['first_trigger_pos_mean'])}, {f(v['first_trigger_pos_median'])} | "
                         f"{v['first_trigger_kind']['decisive']} / {v['first_trigger_kind']['ordinary']} | "
                         f"{f(v['rho_before_first_mean'])} / {f(v['rho_at_first_mean'])} / "
                         f"{f(v['rho_after_first_mean'])} |")
        lines.append("")
        for e in r["by_delta"].get("0.001", {}).get("examples", []):
            lines.append(f"- A = {e['advantage']}, trigger at {e['first_trigger']} (rho {e['rho_at_trigger']:.2g}), "
                         f"{e['num_after']} tokens after it (mean rho {e['rho_after_mean']:.3f}): `{e['text']}`")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="*", type=Path, help="kept run folders (default: benchmarks/cache/toy_lab/kept/toy_lab_long-*)")
    common_arguments(ap, "toy_lab_triggers")
    args = ap.parse_args(argv)
    dirs = args.run_dirs or sorted((CACHE / "kept").glob("toy_lab_long-*"))
    if not dirs:
        raise SystemExit("[toy_lab] no kept run folder: run `python -m benchmarks toy_lab --setting long` first "
                         "(it keeps mu-grpo and grpo-stale-relaxed at seed 0), or pass run folders")
    torch.set_num_threads(1)
    results = [analyse(d) for d in dirs]
    write_result(args.out, "toy_lab_triggers", {"runs": results}, args)
    print(markdown(results))
    print(f"[toy_lab] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
