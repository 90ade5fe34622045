"""Where the default job's memory goes: peak resident memory of its whole process tree, by phase.

    PYTHONPATH=. .venv/bin/python -m benchmarks memory job                 # bash scripts/train.sh, ~5-15 min
    PYTHONPATH=. .venv/bin/python -m benchmarks memory job --label short -- schedule.total_updates=8 ...

``job`` runs ``bash scripts/train.sh --run-dir DIR [overrides]`` (the README's first command) and samples
every 0.1 s the resident memory of its whole process tree (the job's process by ``VmRSS``, any
child by ``Pss``, so a forked child's shared pages are not counted twice), and each process's own
high-water mark (``VmHWM``, what ``/usr/bin/time -v`` reports as its maximum resident set size). A sample is labelled with the phase the run is in, read from what
the run has written so far: ``start`` (model load, engine start, the starting evaluation) until the
first record, then ``stage S generate`` until the stage's data is on disk, ``stage S optimise`` until
its stage record, and the stage end (evaluation, checkpoint) until the next stage's data. The result
(in the suite's schema, :mod:`benchmarks.suite`) holds the peak of the tree, the peak per phase, the
run's learning (stage rewards, greedy held-out accuracy) and clock, and the timeline.

Sampling misses a peak shorter than 0.1 s; ``VmHWM`` does not (it is the kernel's own high-water
mark), so both are reported: ``peak_tree_gb`` (sampled sum) and ``peak_hwm_gb`` (the largest single
process's high-water mark; with the in-process vLLM engine the job is one process).

Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.suite import ROOT, common_arguments, command, worktree, write_result

WORK = ROOT / "benchmarks" / "cache" / "memory"
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
GIB = 2**30


def _status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _pss_kib(pid: int) -> int:
    """The process's proportional share of resident memory (a page shared by n processes counts 1/n):
    summed over a tree it counts a forked child's copy-on-write pages once, where VmRSS counts them twice."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant (read from /proc/*/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def phase(run_dir: Path, records: list[dict]) -> str:
    """The phase a run is in, from what it has written (see the module docstring)."""
    if not records:
        return "start"
    stage = sum(1 for r in records if r.get("kind") == "stage")
    if stage and not any((run_dir / "checkpoints").glob(f"ckpt_*_s{stage:03d}_u00000")):
        return f"stage {stage - 1} checkpoint"
    data = run_dir / "stages" / f"stage_{stage:03d}"
    if stage and stage == _num_stages(run_dir):
        return "end (export)"
    if not any(data.glob("rollouts_rank*.safetensors")):
        return f"stage {stage} generate"
    return f"stage {stage} optimise"


def _num_stages(run_dir: Path) -> int | None:
    import yaml

    try:
        schedule = yaml.safe_load((run_dir / "config.yaml").read_text())["schedule"]
    except (OSError, KeyError, TypeError):
        return None
    return schedule["num_stages"] or -(-schedule["total_updates"] // schedule["updates_per_stage"])


def _read_records(path: Path, seen: list[dict]) -> list[dict]:
    if not path.is_file():
        return seen
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()] if len(lines) != len(seen) else seen


def sample(cmd: list[str], run_dir: Path, log: Path, env: dict, cwd: Path = ROOT, interval_s: float = 0.1) -> dict:
    """Run ``cmd``, sampling its process tree's memory until it exits."""
    log.parent.mkdir(parents=True, exist_ok=True)
    timeline, hwm, records = [], {}, []
    t0 = time.perf_counter()
    trace = open(log.with_suffix(".rss.tsv"), "w")  # the samples as they come, for a run stopped early
    with open(log, "w") as fh, trace:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **ENV, **env}, stdout=fh, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            pids = tree(proc.pid)
            # the job's own process by VmRSS (what its high-water mark measures), any child by its Pss
            rss = _status_kib(proc.pid, "VmRSS") + sum(_pss_kib(p) for p in pids if p != proc.pid)
            for p in pids:
                hwm[p] = max(hwm.get(p, 0), _status_kib(p, "VmHWM"))
            records = _read_records(run_dir / "metrics.jsonl", records)
            timeline.append((round(time.perf_counter() - t0, 2), rss, phase(run_dir, records), len(pids)))
            trace.write("%.1f\t%.3f\t%.3f\t%s\n" % (timeline[-1][0], rss / 2**20, max(hwm.values()) / 2**20,
                                                     timeline[-1][2]))
            trace.flush()
            time.sleep(interval_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"[memory] {' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    peaks: dict[str, float] = {}
    for _, rss, name, _ in timeline:
        peaks[name] = max(peaks.get(name, 0.0), rss * 1024 / GIB)
    return {"wall_s": wall, "peak_tree_gb": max(r for _, r, _, _ in timeline) * 1024 / GIB,
            "peak_hwm_gb": max(hwm.values()) * 1024 / GIB, "num_processes_max": max(n for *_, n in timeline),
            "peak_by_phase_gb": peaks, "timeline": [[t, round(r / 2**20, 3), p] for t, r, p, _ in timeline[::10]],
            "log": str(log.relative_to(ROOT))}


def learning(run_dir: Path) -> dict:
    from mugrpo.observability.loggers import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    stages = [r for r in records if r["kind"] == "stage"]
    evals = [r for r in records if r["kind"] == "eval"]
    return {"stage_rewards": [r["reward/mean"] for r in stages],
            "greedy_acc": [e.get("eval/greedy_acc") for e in evals],
            "trainer_clock_s": stages[-1]["time_s"] if stages else None,
            "perf_s": {k: sum(r.get(k, 0.0) for r in stages) for k in
                       ("perf/sync_s", "perf/generate_s", "perf/optimize_s", "perf/eval_s", "perf/checkpoint_s")}}


def plan_lines(log: Path) -> list[str]:
    """The printed plan's engine lines (what the KV cache was sized to)."""
    return [line.strip() for line in log.read_text().splitlines() if "kv" in line.lower() or "engine" in line.lower()][:6]


def part_job(args) -> dict:
    run_dir = WORK / f"job-{args.label}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    tree = worktree(args.commit, WORK) if args.commit else ROOT
    # --direct: what train.sh execs once .venv-vllm exists (no set-up check), with the tree first on the path
    start = ([str(ROOT / ".venv-vllm" / "bin" / "python"), "-m", "mugrpo", "train"] if args.direct
             else ["bash", str(tree / "scripts" / "train.sh")])
    cmd = [*start, "--run-dir", str(run_dir), *args.overrides]
    print(f"[memory] {args.label}: {' '.join(cmd)}", flush=True)
    env = {"PYTHONPATH": str(tree), **({"MALLOC_ARENA_MAX": args.arenas} if args.arenas else {}),
           **dict(kv.split("=", 1) for kv in args.env)}
    out = sample(cmd, run_dir, WORK / f"job-{args.label}.log", env, cwd=tree)
    out.update(learning(run_dir), plan=plan_lines(WORK / f"job-{args.label}.log"), overrides=args.overrides,
               env=args.env, commit=args.commit or "this tree", load_avg_end=list(os.getloadavg()))
    print(f"[memory] {args.label}: {out['wall_s']:.0f} s, peak tree {out['peak_tree_gb']:.2f} GiB, "
          f"HWM {out['peak_hwm_gb']:.2f} GiB; by phase "
          + ", ".join(f"{k} {v:.2f}" for k, v in out["peak_by_phase_gb"].items())
          + f"; rewards {[round(r, 3) for r in out['stage_rewards']]}, greedy {out['greedy_acc']}", flush=True)
    return out


def part_traces(args) -> dict:
    """Peaks by phase from the sample files of earlier ``job`` runs (``WORK/job-LABEL.rss.tsv``), also of
    a run stopped before its end (its last phase says how far it got)."""
    out = {}
    for label in args.labels:
        rows = [line.split("\t") for line in (WORK / f"job-{label}.rss.tsv").read_text().splitlines() if line]
        peaks: dict[str, float] = {}
        for _, tree_gb, _, name in rows:
            peaks[name] = round(max(peaks.get(name, 0.0), float(tree_gb)), 3)
        out[label] = {"peak_by_phase_gb": peaks, "peak_hwm_gb": max(float(r[2]) for r in rows),
                      "seconds_sampled": float(rows[-1][0]), "last_phase": rows[-1][3],
                      "plan": plan_lines(WORK / f"job-{label}.log")}
        if (WORK / f"job-{label}" / "metrics.jsonl").is_file():
            out[label].update(learning(WORK / f"job-{label}"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "memory")
    sub = ap.add_subparsers(dest="part", required=True)
    job = sub.add_parser("job")
    job.add_argument("--label", default="default", help="the result's key (default: default)")
    job.add_argument("--direct", action="store_true",
                     help="run .venv-vllm/bin/python -m mugrpo train (what train.sh execs) instead of train.sh")
    job.add_argument("--commit", default=None, help="run this commit's code (a git worktree under benchmarks/cache)")
    job.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the run's environment")
    job.add_argument("--arenas", default=None, help="MALLOC_ARENA_MAX for the run (default: unset)")
    job.add_argument("overrides", nargs="*", help="key=value overrides after --")
    traces = sub.add_parser("traces")
    traces.add_argument("labels", nargs="+", help="labels of earlier job runs")
    traces.add_argument("--label", default="traces", help="the result's key (default: traces)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    from benchmarks.suite import read_figures

    results = read_figures(out) if out.is_file() else {}
    results[args.label] = {**getattr(sys.modules[__name__], f"part_{args.part}")(args), "command": command()}
    write_result(out, "memory", results, args)
    return 0
