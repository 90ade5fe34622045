"""SmolLM2-135M on the default task: mugrpo grpo (mu = 4) vs mu-grpo (a few large stages) vs TRL.

One command (sizes in :data:`SIZES`; every field can be overridden on the command line)::

    PYTHONPATH=. python -m benchmarks smollm --size smoke   # validation: a few updates, ~minutes
    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks smollm --size default --engine vllm --bf16  # ~1.5 h
    PYTHONPATH=. python -m benchmarks smollm --size full    # the real comparison (hours on 2 cores)

The three methods train the same model (the built-in offline SmolLM2-135M-Instruct) on the default
task of mugrpo's config (reasoning-gym basic_arithmetic, 1-digit, + and -, one-shot chat prompt),
with the same group size, lengths, lr, optimizer, sequences per update and number of updates:

- ``grpo``:    mugrpo preset grpo, mu = 4 (a refresh every 4 updates);
- ``mu-grpo``: mugrpo preset mu-grpo, ``--stages`` stages of mu = updates / stages;
- ``trl``:     TRL 1.16 ``GRPOTrainer`` matched to ``grpo`` (:mod:`benchmarks.smollm.trl_peer`, run in
  its own venv, ``--trl-python``).

Each run is evaluated at ``--eval-points`` evenly spaced updates (and before training) on the same
held-out prompts with the same sampling seed; evaluation time is taken off each run's clock. The
report: reward vs wall-clock, the wall-clock each method needs to reach grpo's (and TRL's) final
evaluated reward, and where the time goes (generation, optimisation, weight sync, checkpoints).
Clocks start when training starts (after model loading) in both frameworks. Benchmarks report; they
never assert on time.

Output: ``benchmarks/results/smollm_<size>.json`` and ``smollm_<size>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.suite import common_arguments, write_result

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "benchmarks" / "cache" / "smollm"


@dataclass
class Size:
    updates: int
    stages: int
    """mu-grpo's number of stages (mu = updates / stages); grpo always uses mu = 4."""
    prompts_per_update: int = 8
    group_size: int = 8
    max_new_tokens: int = 64
    micro_batch_size: int = 16
    """TRL's per-device batch (sequences per forward/backward); mugrpo cuts micro-batches by tokens
    (``schedule.micro_batch_tokens``, its default) since the efficiency work (docs/BENCHMARKS.md 3)."""
    lr: float = 1e-5
    eval_points: int = 8
    eval_prompts: int = 200
    eval_samples: int = 2


SIZES = {
    # Validation of the script: every code path, minutes on a shared 2-core machine; numbers mean nothing.
    "smoke": Size(updates=8, stages=1, prompts_per_update=2, group_size=4, max_new_tokens=32, micro_batch_size=8,
                  eval_points=2, eval_prompts=8, eval_samples=1),
    # The default job's own settings (mugrpo's config defaults: 32 updates x 64 sequences, 48 new tokens,
    # lr 2e-5; mu-grpo 4 stages of mu = 8 vs grpo 8 stages of mu = 4), evaluated at 5 points on 64
    # held-out prompts x 2 samples: about an hour on 2 cores with --engine vllm --bf16.
    "default": Size(updates=32, stages=4, max_new_tokens=48, lr=2e-5, eval_points=4, eval_prompts=64,
                    eval_samples=2),
    # The comparison: 128 updates x 64 sequences; mu-grpo 4 stages of mu = 32 vs grpo 32 stages of mu = 4.
    "full": Size(updates=128, stages=4),
}
METHODS = ("grpo", "mu-grpo", "trl")


def eval_updates(size: Size) -> list[int]:
    step = max(1, size.updates // size.eval_points)
    return sorted({0, *range(step, size.updates + 1, step), size.updates})


def mugrpo_overrides(size: Size, method: str, args) -> list[str]:
    schedule = (["schedule.updates_per_stage=4", "schedule.num_stages=null"] if method == "grpo"
                else [f"schedule.num_stages={size.stages}", "schedule.updates_per_stage=null"])
    return schedule + [
        f"schedule.total_updates={size.updates}", f"schedule.prompts_per_update={size.prompts_per_update}",
        f"rollout.group_size={size.group_size}",
        f"rollout.max_new_tokens={size.max_new_tokens}", f"rollout.engine={args.engine}", f"optim.lr={size.lr}",
        f"train.seed={args.seed}", f"train.threads={args.threads}", f"train.autocast={'bf16' if args.bf16 else 'none'}",
        f"rollout.dtype={'bfloat16' if args.bf16 else 'float32'}",
        "train.progress=false", "train.save_stage_text=false", "train.save_final_model=false",
        f"task.eval_size={size.eval_prompts}", "checkpoint.keep_last=1",
        # The benchmark evaluates with its own evaluator, off the clock; mugrpo's built-in evaluation
        # (greedy, at the start and at stage ends) would stay on it, and grpo has twice the stages.
        "eval.at_start=false", "eval.every_stages=0",
    ]


def run_mugrpo(method: str, size: Size, args) -> dict:
    from benchmarks.evaluate import UpdateEvaluator, patched_trainer
    from mugrpo import pipeline
    from mugrpo.config import load_config
    from mugrpo.observability.loggers import read_metrics
    from mugrpo.models.loading import load_tokenizer, resolve_model_path
    from mugrpo.rollout.tasks import build_task

    cfg = load_config(method, overrides=mugrpo_overrides(size, method, args))
    run_dir = WORK / f"{method}-{args.size}"
    shutil.rmtree(run_dir, ignore_errors=True)
    tokenizer = load_tokenizer(resolve_model_path(cfg.model.name, cfg.model.cache_dir))
    evaluator = UpdateEvaluator(tokenizer, build_task(cfg.task), cfg.task, eval_updates(size),
                                samples=size.eval_samples, max_new_tokens=size.max_new_tokens, batch_size=64)
    timers: dict = {}
    with patched_trainer(evaluator, timers):
        pipeline.train(cfg, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    clock = evaluator.clock(records)
    stages = [r for r in records if r["kind"] == "stage"]
    total = clock[max(clock)]

    def spent(key):
        return sum(r.get(key) or 0.0 for r in stages)

    # Evaluations run inside Trainer.update calls, hence inside the trainer's perf/optimize_s.
    breakdown = {"generate_s": spent("perf/generate_s"), "optimize_s": spent("perf/optimize_s") - evaluator.eval_s,
                 "sync_s": spent("perf/sync_s"), "score_s": spent("perf/score_s"),
                 # The last save comes after the last update, outside the run's clock.
                 "checkpoint_s": sum(timers["checkpoint_durations_s"][:-1]),
                 "num_checkpoints": len(timers["checkpoint_durations_s"])}
    breakdown["other_s"] = total - sum(v for k, v in breakdown.items() if k.endswith("_s"))
    # Stage rewards are the behaviour policy's, measured at the start of the stage.
    starts = {r["stage"]: r["update"] - r["update_in_stage"] for r in stages}
    train_curve = [{"update": starts[r["stage"]], "reward": r.get("reward/mean"),
                    "time_s": clock.get(starts[r["stage"]], 0.0) if starts[r["stage"]] else 0.0} for r in stages]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"method": method, "preset": method, "total_s": total, "eval_s": evaluator.eval_s, "breakdown": breakdown,
            "eval": [{**p, "time_s": clock.get(p["update"], 0.0)} for p in evaluator.points],
            "train_reward": train_curve, "num_stages": len(stages),
            "updates": [{"update": u, "time_s": t} for u, t in sorted(clock.items())]}


def run_trl(size: Size, args) -> dict:
    from mugrpo.config import load_config
    from mugrpo.models.loading import resolve_model_path

    python = Path(args.trl_python)
    if not python.is_file():
        return {"method": "trl",
                "skipped": f"no TRL interpreter at {python}; install it as docs/BENCHMARKS.md says (section 2)"}
    cfg = load_config("grpo")
    out = WORK / f"trl-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "benchmarks.smollm.trl_peer", "--model", resolve_model_path(cfg.model.name),
           "--out", str(out), "--updates", str(size.updates), "--prompts-per-update", str(size.prompts_per_update),
           "--group-size", str(size.group_size), "--micro-batch-size", str(size.micro_batch_size),
           "--max-new-tokens", str(size.max_new_tokens), "--lr", str(size.lr), "--seed", str(args.seed),
           "--threads", str(args.threads), "--eval-prompts", str(size.eval_prompts),
           "--eval-samples", str(size.eval_samples), "--eval-at", *map(str, eval_updates(size))]
    if args.bf16:
        cmd.append("--bf16")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    rec = json.loads(out.read_text())
    shutil.rmtree(out.with_suffix(".trl_tmp"), ignore_errors=True)
    total = rec["total_s"]
    train_curve = [{"update": u["update"], "reward": u["reward"], "time_s": u["time_s"]}
                   for u in rec["updates"] if u.get("reward") is not None]
    return {"method": "trl", "total_s": total, "eval": rec["eval"], "train_reward": train_curve,
            "breakdown": {"generate_s": rec["generate_s"], "optimize_s": total - rec["generate_s"]},
            "updates": rec["updates"], "versions": rec["versions"], "trl_args": rec["trl_args"]}


def time_to_reach(run: dict, target: float) -> float | None:
    """Clock time of the first evaluation point at or above ``target`` (None if never)."""
    for p in run["eval"]:
        if p["pass1"] >= target - 1e-12:
            return p["time_s"]
    return None


def compare(runs: dict[str, dict], size: Size) -> dict:
    """The goals of issue 7, computed from the evaluation points (reported, never asserted)."""
    n = size.eval_prompts * size.eval_samples
    out = {"eval_samples_per_point": n,
           "eval_standard_error": {m: (r["eval"][-1]["pass1"] * (1 - r["eval"][-1]["pass1"]) / n) ** 0.5
                                   for m, r in runs.items() if r.get("eval")}}
    for ref in ("grpo", "trl"):
        if ref not in runs or not runs[ref].get("eval"):
            continue
        target = runs[ref]["eval"][-1]["pass1"]
        row = {"target_pass1": target, "ref_total_s": runs[ref]["total_s"]}
        for m, r in runs.items():
            if m == ref or not r.get("eval"):
                continue
            t = time_to_reach(r, target)
            row[m] = {"time_to_reach_s": t, "fraction_of_ref_time": t / runs[ref]["total_s"] if t is not None else None,
                      "final_pass1": r["eval"][-1]["pass1"], "final_minus_target": r["eval"][-1]["pass1"] - target}
        out[f"vs_{ref}"] = row
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "black", "mu-grpo": "tab:blue", "trl": "tab:green"}
    runs = {m: r for m, r in result["runs"].items() if r.get("eval")}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for m, r in runs.items():
        axes[0].plot([p["time_s"] / 60 for p in r["eval"]], [p["pass1"] for p in r["eval"]], "o-", color=colors[m],
                     label=f"{m} (held-out)")
        tr = [p for p in r["train_reward"] if p["reward"] is not None]
        if tr:
            axes[0].plot([p["time_s"] / 60 for p in tr], [p["reward"] for p in tr], ".:", color=colors[m], alpha=0.6,
                         label=f"{m} (train batch)")
        axes[1].plot([u["update"] for u in r["updates"]], [u["time_s"] / 60 for u in r["updates"]], color=colors[m],
                     label=m)
    axes[0].set_xlabel("wall-clock (min, evaluation excluded)")
    axes[0].set_ylabel("pass@1 (T=1)")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("optimizer update")
    axes[1].set_ylabel("wall-clock (min)")
    axes[1].legend(fontsize=8)
    parts = ("generate_s", "optimize_s", "sync_s", "score_s", "checkpoint_s", "other_s")
    bottom = {m: 0.0 for m in runs}
    for part in parts:
        vals = [max(runs[m]["breakdown"].get(part, 0.0), 0.0) / 60 for m in runs]
        if any(vals):
            axes[2].bar(list(runs), vals, bottom=[bottom[m] for m in runs], label=part[:-2])
            for m, v in zip(runs, vals):
                bottom[m] += v
    axes[2].set_ylabel("minutes")
    axes[2].legend(fontsize=7)
    axes[2].set_title("where the time goes (TRL generate: + scoring, old log-probs)", fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    s = result["size"]
    fig.suptitle(f"SmolLM2-135M, default task, {s['updates']} updates x {s['prompts_per_update']}x{s['group_size']} "
                 f"seqs, mu-grpo {s['stages']} stages, {'bf16' if result['bf16'] else 'fp32'}, "
                 f"engine {result['engine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="smoke")
    for f, v in asdict(SIZES["full"]).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=None, help=f"override the size's {f}")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="mugrpo rollout engine")
    ap.add_argument("--bf16", action="store_true",
                    help="mugrpo: bf16 autocast in the trainer and a bfloat16 rollout engine; TRL: bf16=True")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    common_arguments(ap, "smollm")
    ap.set_defaults(out=None)  # benchmarks/results/smollm_<size>.json
    args = ap.parse_args(argv)
    size = SIZES[args.size]
    size = Size(**{f: getattr(args, f) if getattr(args, f) is not None else v for f, v in asdict(size).items()})
    torch.set_num_threads(args.threads)
    out = Path(args.out or RESULTS / f"smollm_{args.size}.json")
    result = {"benchmark": "smollm", "size_name": args.size, "size": asdict(size), "engine": args.engine,
              "bf16": args.bf16, "seed": args.seed, "runs": {}}
    for method in args.methods:
        print(f"[smollm] {method} ...", flush=True)
        t0 = time.perf_counter()
        run = run_trl(size, args) if method == "trl" else run_mugrpo(method, size, args)
        run["process_wall_s"] = time.perf_counter() - t0
        result["runs"][method] = run
        if run.get("eval"):
            print(f"[smollm] {method}: pass@1 {run['eval'][0]['pass1']:.3f} -> {run['eval'][-1]['pass1']:.3f} "
                  f"in {run['total_s']:.0f} s ({run['breakdown']})", flush=True)
        else:
            print(f"[smollm] {method}: {run.get('skipped')}", flush=True)
        result["comparison"] = compare(result["runs"], size)
        write_result(out, "smollm", result, args, finished=len(result["runs"]) == len(args.methods),
                     threads=args.threads)
    plot(result, out.with_suffix(".png"))
    print(f"[smollm] wrote {out} and {out.with_suffix('.png')}")
    print(json.dumps(result["comparison"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
