"""Efficiency of the default job: an earlier commit ("before") against this tree ("after").

Three parts, one command each; every number goes into ``benchmarks/results/efficiency.json`` (each
part replaces its own key), with the CPU capability beside it, and ``job`` also draws
``benchmarks/results/efficiency_job.png``. docs/benchmarks/efficiency.md (section 4) reads them.

    PYTHONPATH=. .venv/bin/python -m benchmarks efficiency job --before f8ba031   # ~40 min on 2 cores
    PYTHONPATH=. .venv/bin/python -m benchmarks efficiency update RUN_DIR         # ~5 min
    PYTHONPATH=. .venv/bin/python -m benchmarks efficiency memory --before f8ba031 # ~5 min

- ``job``: the default job end to end, as the README runs it: ``before`` in a git worktree of that
  commit (its own defaults: HF engine, bf16 autocast), then ``bash scripts/train.sh`` here (the
  vLLM engine, ``auto`` precision), then the same with ``MUGRPO_SKIP_VLLM=1`` (the HF engine
  fallback). Wall-clock, peak resident memory, and per stage: reward, greedy held-out accuracy,
  seconds per phase, optimise seconds per update.
- ``update``: on a finished run's stage-1 data, seconds per optimizer update of the plain path and
  with each saving alone and together (SGD with lr 0, so every variant sees the same weights), and
  useful-token throughput (response tokens of A != 0 sequences per second) against a bare PyTorch
  forward+backward loop over just those sequences, each with its whole prompt, no sharing.
- ``memory``: peak resident memory of one stage of 64 sequences plus one update on the HF engine
  in float32, before and after.

Benchmarks report; they never assert on time. Run them on a quiet machine: the vLLM CPU engine
binds its threads to the cores and slows down many times over when another process competes.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.suite import common_arguments, command, read_figures, read_stage_data, worktree, write_result

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "cache" / "efficiency"
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# Runs a command and prints its peak resident set (the largest descendant it waited for), in KiB.
MAXRSS = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
          "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); sys.exit(rc)")


def machine() -> dict:
    from mugrpo.hardware import detect

    hw = detect()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return {"cpu_capability": hw.cpu_capability, "native_bf16": hw.native_bf16, "cpu_model": model,
            "cpus": os.cpu_count(), "torch": torch.__version__, "loadavg": os.getloadavg()}


def measured(cmd: list[str], cwd: Path, env: dict, log: Path) -> dict:
    """Run ``cmd`` under the peak-memory wrapper; wall-clock and peak RSS."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, "-c", MAXRSS, *cmd], cwd=cwd, env={**os.environ, **ENV, **env},
                              stdout=fh, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    rss = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("MAXRSS_KB")]
    if proc.returncode != 0:
        raise SystemExit(f"[efficiency] {' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return {"wall_s": wall, "peak_rss_gb": rss[-1] / 2**20 if rss else None, "command": " ".join(cmd), "log": str(log)}


def stage_table(run_dir: Path) -> dict:
    from mugrpo.observability.loggers import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    stages = [r for r in records if r["kind"] == "stage"]
    evals = [r for r in records if r["kind"] == "eval"]
    updates = [r for r in records if r["kind"] == "update"]
    keys = ("reward/mean", "stage/zero_var_group_frac", "stage/response_len_mean", "perf/sync_s", "perf/generate_s",
            "perf/score_s", "perf/optimize_s", "perf/eval_s", "perf/checkpoint_s")
    rows = []
    for r in stages:
        n = sum(1 for u in updates if u["stage"] == r["stage"])
        after = [e for e in evals if e["stage"] == r["stage"] and e["update"] == r["update"]]
        rows.append({**{k: r.get(k) for k in keys}, "stage": r["stage"], "num_updates": n,
                     "optimize_s_per_update": r["perf/optimize_s"] / max(n, 1),
                     "greedy_acc_after": after[-1].get("eval/greedy_acc") if after else None,
                     "trained_seq_frac": _mean(u.get("loss/trained_seq_frac") for u in updates if u["stage"] == r["stage"])})
    start = [e.get("eval/greedy_acc") for e in evals if e["update"] == 0 and e["stage"] == 0]
    later = [r["optimize_s_per_update"] for r in rows if r["stage"] >= 1]
    return {"stages": rows, "greedy_acc_start": start[0] if start else None,
            "trainer_clock_s": stages[-1]["time_s"] if stages else None,
            "optimize_s_per_update_stages_ge1": _mean(later)}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def part_job(args) -> dict:
    before = worktree(args.before, WORK)
    out = {}
    variants = [
        ("before", [str(ROOT / ".venv" / "bin" / "python"), "-m", "mugrpo", "train"], before, {"PYTHONPATH": str(before)}),
        ("after", ["bash", str(ROOT / "scripts" / "train.sh")], ROOT, {}),
        ("after_hf", ["bash", str(ROOT / "scripts" / "train.sh")], ROOT, {"MUGRPO_SKIP_VLLM": "1"}),
        # grpo (mu = 4: 8 refreshes) on the same engine, for the per-refresh cost against mu-grpo's 4
        ("after_grpo", ["bash", str(ROOT / "scripts" / "train.sh"), "--preset", "grpo"], ROOT, {}),
        # float32 everywhere, what `auto` picks on an AVX2-only CPU: the per-phase base of the AVX2 estimate
        ("after_fp32", ["bash", str(ROOT / "scripts" / "train.sh"), "train.autocast=none"], ROOT, {}),
    ]
    for name, cmd, cwd, env in variants:
        if args.only and name not in args.only:
            continue
        run_dir = WORK / f"job-{name}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        print(f"[efficiency] job {name}: {' '.join(cmd)} (cwd {cwd})", flush=True)
        result = measured([*cmd, "--run-dir", str(run_dir)], cwd, env, WORK / f"job-{name}.log")
        out[name] = {**result, **stage_table(run_dir), "machine": machine()}
        print(f"[efficiency] job {name}: {result['wall_s']:.0f} s, peak {result['peak_rss_gb']:.2f} GB, optimise "
              f"{out[name]['optimize_s_per_update_stages_ge1']:.2f} s/update in stages >= 1", flush=True)
    return out


def part_memory(args) -> dict:
    before = worktree(args.before, WORK)
    overrides = ["rollout.engine=hf", "train.autocast=none", "rollout.dtype=float32", "schedule.total_updates=1",
                 "schedule.num_stages=1", "rollout.prompts_per_stage=8", "schedule.prompts_per_update=8",
                 "eval.num_items=0", "train.save_final_model=false", "train.progress=false"]
    out = {}
    for name, cwd, python in (("before", before, ROOT / ".venv" / "bin" / "python"),
                              ("after", ROOT, ROOT / ".venv" / "bin" / "python")):
        run_dir = WORK / f"memory-{name}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        cmd = [str(python), "-m", "mugrpo", "train", "--run-dir", str(run_dir), *overrides]
        out[name] = measured(cmd, cwd, {"PYTHONPATH": str(cwd)}, WORK / f"memory-{name}.log")
        print(f"[efficiency] memory {name}: peak {out[name]['peak_rss_gb']:.2f} GB", flush=True)
    out["what"] = "one stage of 8 prompts x G = 8 (64 sequences) plus one update, HF engine, float32, SmolLM2-135M"
    out["machine"] = machine()
    return out


def part_update(args) -> dict:
    from mugrpo.config import load_config
    from mugrpo.run_dir import RunDir
    from mugrpo.kit.distributed import World
    from mugrpo.hardware import detect, resolve
    from mugrpo.models.loading import load_policy, resolve_model_path
    from mugrpo.config.plan import make_plan
    from mugrpo.stages.state import RLState
    from mugrpo.training.trainer import Trainer

    run_dir = Path(args.run_dir)
    data = read_stage_data(RunDir(run_dir).stage(1))
    policy = load_policy(resolve_model_path("smollm2-135m-instruct"))
    torch.set_num_threads(args.threads)
    variants = {
        "plain": ["train.skip_zero_advantage=false", "train.shared_prefix=false", "schedule.micro_batch_size=16",
                  "schedule.micro_batch_tokens=1000000"],  # the earlier path: fixed micro-batches of 16
        "skip": ["train.shared_prefix=false", "schedule.micro_batch_size=16", "schedule.micro_batch_tokens=1000000"],
        "shared": ["train.skip_zero_advantage=false"],
        "tokens": ["train.skip_zero_advantage=false", "train.shared_prefix=false"],
        "all": [],
    }
    out = {"updates": list(range(args.updates)), "threads": args.threads, "variants": {}}
    for name, overrides in variants.items():
        cfg = load_config("mu-grpo", overrides=[f"train.autocast={args.autocast}", *overrides])
        resolved = resolve(cfg.train.autocast, "auto", "hf", detect())
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # weights stay put: every variant sees the same
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        seconds, trained_tokens = [], 0
        for u in out["updates"]:
            t0 = time.perf_counter()
            m = Trainer(cfg, make_plan(cfg), World(), policy, optimizer, scheduler, resolved=resolved,
                        state=RLState(stage=1, update_in_stage=u)).update(data)
            seconds.append(time.perf_counter() - t0)
            trained_tokens = m["loss/num_tokens"] if name == "all" else trained_tokens
        out["variants"][name] = {"s_per_update": sum(seconds) / len(seconds), "seconds": seconds,
                                 "autocast": resolved.autocast}
        print(f"[efficiency] update {name}: {out['variants'][name]['s_per_update']:.2f} s/update", flush=True)
    out["bare"] = bare_loop(policy, data, out["updates"], cfg, resolved.autocast == "bf16")
    useful = out["bare"]["useful_tokens"]
    for name, v in out["variants"].items():
        v["useful_tok_s"] = useful / (v["s_per_update"] * len(out["updates"]))
        v["vs_bare"] = v["useful_tok_s"] / out["bare"]["useful_tok_s"]
        v["speedup_vs_plain"] = out["variants"]["plain"]["s_per_update"] / v["s_per_update"]
    out["machine"] = machine()
    return out


def bare_loop(policy, data, updates: list[int], cfg, autocast: bool) -> dict:
    """Forward+backward over just the A != 0 sequences of the same updates, each with its whole prompt:
    plain HF calls in micro-batches of 16, no sharing, no diagnostics, no optimizer step."""
    from mugrpo.kit.batching import collate
    from mugrpo.kit.order import update_groups

    G = data.group_size
    seconds, tokens = 0.0, 0
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    for u in updates:
        groups = update_groups(data.num_groups, cfg.schedule.prompts_per_update, u, cfg.train.seed, 1)
        seqs = [g * G + j for g in groups for j in range(G) if float(data.advantages[g * G + j]) != 0.0]
        tokens += sum(len(data.responses[s]) for s in seqs)
        t0 = time.perf_counter()
        for i in range(0, len(seqs), 16):
            mb = collate(data, seqs[i:i + 16], pad_id=0)
            with ctx:
                logits = policy(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                                logits_to_keep=mb.response_len + 1, use_cache=False).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)
            (-(logp * mb.advantages[:, None] * mb.response_mask).sum()).backward()
        seconds += time.perf_counter() - t0
        policy.zero_grad(set_to_none=True)
    return {"useful_tokens": tokens, "seconds": seconds, "useful_tok_s": tokens / seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "efficiency")
    sub = ap.add_subparsers(dest="part", required=True)
    job = sub.add_parser("job")
    job.add_argument("--before", default="f8ba031")
    job.add_argument("--only", nargs="*", choices=("before", "after", "after_hf", "after_grpo", "after_fp32"))
    update = sub.add_parser("update")
    update.add_argument("run_dir")
    update.add_argument("--updates", type=int, default=4, help="the stage's first N minibatches")
    update.add_argument("--threads", type=int, default=2)
    update.add_argument("--autocast", default="auto", choices=("auto", "none", "bf16"))
    memory = sub.add_parser("memory")
    memory.add_argument("--before", default="f8ba031")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = read_figures(out) if out.is_file() else {}
    part = {"job": part_job, "update": part_update, "memory": part_memory}[args.part](args)
    key = args.part if args.part != "update" else f"update_{args.autocast}"
    # each part keeps the machine and command it ran under (parts run at different times)
    results[key] = {**results.get(key, {}), **part, "command": shlex.join(command())}
    write_result(out, "efficiency", results, args)
    if args.part == "job":
        plot_job({k: v for k, v in results["job"].items() if k in ("before", "after", "after_hf")},
                 out.with_name("efficiency_job.png"))
    print(f"[efficiency] wrote {out}")
    return 0


def plot_job(job: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, run in job.items():
        if not isinstance(run, dict) or "stages" not in run:
            continue
        stages = run["stages"]
        label = f"{name} ({run['wall_s'] / 60:.1f} min)"
        axes[0].plot([r["stage"] for r in stages], [r["reward/mean"] for r in stages], "o-", label=label)
        axes[1].plot([-1] + [r["stage"] for r in stages], [run["greedy_acc_start"]] + [r["greedy_acc_after"] for r in stages],
                     "o-", label=label)
        axes[2].bar([f"{name}\ns{r['stage']}" for r in stages], [r["optimize_s_per_update"] for r in stages])
    axes[0].set(xlabel="stage", ylabel="reward/mean (512 rollouts)", title="reward per stage")
    axes[1].set(xlabel="after stage (-1: start)", ylabel="greedy acc (64 held-out)", title="greedy eval")
    axes[2].set(ylabel="s", title="optimise seconds per update")
    axes[2].tick_params(axis="x", labelsize=6)
    for ax in axes[:2]:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    cap = next((r["machine"]["cpu_capability"] for r in job.values() if isinstance(r, dict) and "machine" in r), "?")
    fig.suptitle(f"The default job, before vs after (CPU capability {cap})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
