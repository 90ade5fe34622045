"""Dynamic sampling on a task the model mostly fails (issue 21 part 4): the toy lab's model, less warm.

One command::

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m benchmarks toy_lab_dynamic          # 2 presets x on/off x 2 seeds
    PYTHONPATH=. python -m benchmarks toy_lab_dynamic --plot                      # redraw the figure

The model is the toy lab's 1.06M-parameter character Llama (:mod:`benchmarks.toy_lab.warmstart`),
warm-started by the same SFT but stopped earlier (``--sft-steps``, default 100 instead of 125), so
that it fails most prompts and most groups of G = 8 are all wrong (zero reward variance: no gradient).
The task, prompts and reward are the toy lab's (2-term 1-digit sums, bare prompts, the built-in
boxed-answer scorer). Each run is :func:`benchmarks.toy_lab.run.run_one` (the trainer, plus an
evaluation of the current policy every ``--eval-every`` updates on fixed held-out prompts, its time
taken off the clock) with ``rollout.dynamic_sampling`` off or on.

What it answers: held-out pass@1 against the training wall-clock and against the tokens generated,
with and without dynamic sampling, for grpo (mu = 4) and mu-grpo (stale stages), over seeds.

Output: ``benchmarks/results/toy_lab_dynamic.json`` (settings, machine, every run's evaluation
curve, its stages' generation counts and dynamic-sampling metrics, a summary) and
``toy_lab_dynamic.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.suite import common_arguments, read_figures
from benchmarks.toy_lab import run as lab
from benchmarks.toy_lab import warmstart

DYNAMIC_KEYS = ("stage/informative_frac", "stage/num_rounds", "stage/num_extra_sequences",
                "stage/num_informative_groups", "stage/zero_var_group_frac", "perf/extra_generate_s",
                "stage/kept_reward_mean", "perf/score_s")


def experiments(presets: list[str], oversample: float, max_rounds: int) -> list[tuple[str, str, list[str]]]:
    """(name, preset, overrides): each preset without and with dynamic sampling."""
    on = ["rollout.dynamic_sampling=true", f"rollout.dynamic_oversample={oversample}",
          f"rollout.dynamic_max_rounds={max_rounds}"]
    # The char model's context is 512 positions; the default task.max_prompt_tokens (512) plus the
    # answer would not fit, which the start-up check refuses. The lab's prompts are ~25 tokens.
    fit = ["task.max_prompt_tokens=128"]
    return [(p + suffix, p, fit + extra) for p in presets for suffix, extra in (("", []), ("+dynamic", on))]


def generated_tokens(stages: list[dict]) -> list[tuple[int, float]]:
    """(first update of the stage, tokens its generation phase produced), from the stage records:
    tokens = perf/generate_tok_s x perf/generate_s (the trainer logs the rate and the seconds)."""
    out = []
    for s in stages:
        start = s["update"] - (s.get("stage/num_updates") or 0)
        out.append((start, (s.get("perf/generate_tok_s") or 0.0) * (s.get("perf/generate_s") or 0.0)))
    return out


def tokens_before(stages: list[dict], update: int) -> float:
    """Tokens generated before the policy of ``update`` existed: every stage that began before it
    (update 0, the initial policy: none)."""
    return sum(tokens for start, tokens in generated_tokens(stages) if start < update)


def summarise(runs: list[dict]) -> dict:
    """Per experiment, over seeds: final pass@1 (mean of the last two evaluations), the run's
    training seconds, generated tokens and sequences, the informative fraction of the groups
    generated, the rounds per stage, and the informative fraction of the groups trained on."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        rs = [r for r in runs if r["name"] == name]

        def stat(values):
            values = [v for v in values if v is not None and v == v]
            if not values:
                return None
            return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "values": values}

        stage = lambda r, k: [s.get(k) for s in r["stages"] if s.get(k) is not None]  # noqa: E731
        out[name] = {
            "preset": rs[0]["preset"], "num_seeds": len(rs), "initial_pass1": rs[0]["eval"][0]["pass1"],
            "final_pass1": stat([statistics.fmean(p["pass1"] for p in r["eval"][-2:]) for r in rs]),
            "train_s": stat([r["train_s"] for r in rs]),
            "generate_s": stat([sum(stage(r, "perf/generate_s")) for r in rs]),
            "generated_tokens": stat([tokens_before(r["stages"], 10**9) for r in rs]),
            "generated_sequences": stat([sum(stage(r, "stage/num_sequences"))
                                         + sum(stage(r, "stage/num_extra_sequences")) for r in rs]),
            "informative_frac_generated": stat([statistics.fmean(stage(r, "stage/informative_frac") or [float("nan")])
                                                for r in rs]),
            "zero_var_frac_trained": stat([statistics.fmean(stage(r, "stage/zero_var_group_frac")) for r in rs]),
            "rounds_per_stage": stat([statistics.fmean(stage(r, "stage/num_rounds") or [1]) for r in rs]),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "toy_lab_dynamic", seeds=[0, 1])
    ap.add_argument("--presets", nargs="+", default=["grpo", "mu-grpo"])
    ap.add_argument("--sft-steps", type=int, default=100,
                    help="the warm start's SFT steps (the toy lab's own warm start stops at 125, pass@1 ~0.3)")
    ap.add_argument("--oversample", type=float, default=2.0)
    ap.add_argument("--max-rounds", type=int, default=4)
    ap.add_argument("--total-updates", type=int, default=64)
    ap.add_argument("--stale-stages", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt (the task holds out 80)")
    ap.add_argument("--only", nargs="*", help="run only these experiment names")
    ap.add_argument("--plot", action="store_true", help="only redraw the figure from --out")
    args = ap.parse_args(argv)
    out_path = Path(args.out)
    if args.plot:
        print(f"[dynamic] wrote {plot(out_path)}")
        return 0
    size = lab.LabSize(total_updates=args.total_updates, stale_stages=args.stale_stages, lr=args.lr,
                       eval_every=args.eval_every, eval_prompts=args.eval_prompts, eval_samples=args.eval_samples)
    torch.set_num_threads(size.threads)
    # A fixed number of SFT steps (the target is out of reach; one check at the last step records pass@1).
    spec = warmstart.WarmStartSpec(sft_max_steps=args.sft_steps, eval_every=args.sft_steps, target_pass1=1.01)
    model_dir = warmstart.build(spec)
    warm = json.loads((model_dir / "warmstart.json").read_text())
    size.max_new_tokens = warm["max_new_tokens"]
    # run_one keeps the stage keys it is told about: add the dynamic-sampling ones.
    lab.STAGE_KEYS = tuple(dict.fromkeys(lab.STAGE_KEYS + DYNAMIC_KEYS))
    exps = [e for e in experiments(args.presets, args.oversample, args.max_rounds)
            if not args.only or e[0] in args.only]
    result = {"benchmark": "toy_lab_dynamic", "size": asdict(size), "warmstart": warm,
              "dynamic": {"oversample": args.oversample, "max_rounds": args.max_rounds}, "runs": []}
    t_all, cpu_all = time.perf_counter(), lab._cpu_s()
    for seed in args.seeds:  # seed-major: a partial result already has every experiment at seed 0
        for name, preset, overrides in exps:
            print(f"[dynamic] {name} seed {seed} ...", flush=True)
            run = lab.run_one(name, preset, overrides, seed, size, model_dir, spec, warmstart.CACHE / "runs")
            for p in run["eval"]:
                p["generated_tokens"] = tokens_before(run["stages"], p["update"])
            result["runs"].append(run)
            ev = run["eval"]
            print(f"[dynamic] {name} seed {seed}: pass@1 {ev[0]['pass1']:.3f} -> {ev[-1]['pass1']:.3f} "
                  f"({run['train_s']:.0f} s train, {tokens_before(run['stages'], 10**9):.0f} tokens)", flush=True)
            result["summary"] = summarise(result["runs"])
            result["total_s"], result["total_cpu_s"] = time.perf_counter() - t_all, lab._cpu_s() - cpu_all
            finished = len(result["runs"]) == len(args.seeds) * len(exps)
            lab.write_lab_result(out_path, "toy_lab_dynamic", result, args, finished=finished)
    print(f"[dynamic] wrote {plot(out_path)}")
    return 0


def plot(path: Path) -> Path:
    """Top: held-out pass@1 against training seconds and against generated tokens. Bottom: the
    behaviour policy's reward on its own stage (every generated sequence) against the update and
    against the tokens generated before that stage. One colour per preset, dashed without dynamic
    sampling, solid with; thin lines are seeds, thick their mean (x positions averaged over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = read_figures(path)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    colours = {}
    for name in dict.fromkeys(r["name"] for r in result["runs"]):
        rs = [r for r in result["runs"] if r["name"] == name]
        colour = colours.setdefault(rs[0]["preset"], f"C{len(colours)}")
        style = "-" if name.endswith("+dynamic") else "--"
        curves = [[(p["time_s"], p["pass1"]) for p in r["eval"]] for r in rs]
        by_tokens = [[(p["generated_tokens"], p["pass1"]) for p in r["eval"]] for r in rs]
        stage_by_update = [[(s["update"] - (s.get("stage/num_updates") or 0), s["reward"]) for s in r["stages"]]
                           for r in rs]
        stage_by_tokens = [[(tokens_before(r["stages"], start + 1), reward) for start, reward in xy]
                           for r, xy in zip(rs, stage_by_update)]
        for ax, series in zip(axes.flat, (curves, by_tokens, stage_by_update, stage_by_tokens)):
            for xy in series:
                ax.plot(*zip(*xy), style, color=colour, alpha=0.3, lw=0.8)
            n = min(len(xy) for xy in series)
            mean = [(statistics.fmean(xy[i][0] for xy in series), statistics.fmean(xy[i][1] for xy in series))
                    for i in range(n)]
            ax.plot(*zip(*mean), style, color=colour, lw=2, label=f"{name} ({len(rs)} seeds)")
    labels = (("training wall-clock, s (evaluation excluded)", "held-out pass@1 (sampled, T = 1)"),
              ("tokens generated for training", "held-out pass@1 (sampled, T = 1)"),
              ("update at which the stage starts", "stage reward (behaviour policy, all generated)"),
              ("tokens generated up to and including the stage", "stage reward (behaviour policy, all generated)"))
    for ax, (x, y) in zip(axes.flat, labels):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    axes[0, 1].legend(fontsize=8)
    warm = result["warmstart"]
    fig.suptitle(f"Dynamic sampling on a task the model mostly fails (toy lab, {warm['sft_steps']}-step warm start, "
                 f"held-out pass@1 {result['runs'][0]['eval'][0]['pass1']:.3f} at update 0)", fontsize=10)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
