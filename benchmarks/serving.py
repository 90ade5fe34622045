"""Rollouts on vLLM's own server (issue 38), measured on this machine. A benchmark: it asserts nothing.

Two measurements, each with its own result file:

- ``stage`` (``results/serving_stage.json``): one stage of the default task (``--prompts`` x ``--group-size``
  sampled sequences) through the hand-written service of an earlier commit (``--before``, default 64f6cbb:
  a stdlib HTTP server around an in-process vLLM ``LLM``, one request at a time) and through this tree's
  ``mugrpo serve --engine vllm`` (vLLM's own API server, continuous batching): new tokens per second, and
  the same stage with a greedy evaluation call (``--eval-items`` held-out prompts) sent at the same moment
  from a second client, as a second trainer rank or an evaluation shares a service: when the evaluation is
  answered and when both are. Each arm's client is ``benchmarks/serving_client.py`` run under its own tree.
- ``agent`` (``results/serving_agent.json``): the calculator agent task (``benchmarks/async_stages.py``'s,
  warm-started so that the model calls the tool) with the tool behind ``--latencies`` seconds, one stage of
  ``--prompts`` x ``--group-size`` trajectories generated through one ``mugrpo serve --engine vllm``:
  ``env.lockstep=true`` (every active trajectory's turn in one call, then every tool call) against
  independent trajectories (each sends its next turn when its tool returns). Reported per run: the stage's
  generation seconds (``perf/generate_s``), the engine's busy fraction as the loop saw it
  (``perf/engine_busy_frac``), the tool wait (``perf/tool_wait_s``), tool calls and turns.

    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks serving stage      # results/serving_stage.json
    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks serving agent      # results/serving_agent.json

Services get both cores (``VLLM_CPU_OMP_THREADS_BIND=0-1``); the clients and the trainer one thread (they
wait on the service, or on a sleeping tool). Run directories and the earlier commit's worktree go under
``benchmarks/cache/serving/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.async_stages import listening_url
from benchmarks.suite import common_arguments, worktree, write_result
from mugrpo import faults

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / "cache" / "serving"
BEFORE = "64f6cbb"
"""The last commit with the hand-written service (mugrpo/rollout/service.py's ThreadingHTTPServer)."""


def _record(runs: list, result: dict, out, config: dict) -> None:
    """Print one run's result, keep it, and write the runs so far (an unfinished result)."""
    print(json.dumps(result), flush=True)
    runs.append(result)
    write_result(out, "serving", {"runs": runs}, config, finished=False)


def _env(tree: Path, threads: int, **extra) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "tests"), str(ROOT / "benchmarks")]),
           "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **extra}
    for key in faults.VARIABLES:
        env.pop(key, None)
    return env


def before_tree(commit: str) -> Path:
    """A detached worktree of ``commit`` (made once, kept in the cache)."""
    return worktree(commit, CACHE)


class Service:
    """``mugrpo serve --engine vllm`` from ``tree``; its URL once it listens (the line both versions print)."""

    def __init__(self, tree: Path, model: str, dtype: str, extra: list[str] = ()):
        self.proc = subprocess.Popen([sys.executable, "-m", "mugrpo", "serve", "--engine", "vllm", "--model", model,
                                      "--port", "0", "--dtype", dtype, *extra],
                                     env=_env(tree, 2), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     cwd=tree)
        self.url = listening_url(self.proc)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _dtype() -> str:
    from mugrpo.hardware import detect, resolve

    return resolve("auto", "auto", "vllm", detect()).engine_dtype  # the trainer's rule for rollout.dtype=auto


def stage(args) -> None:
    dtype = _dtype()
    trees = {"before": before_tree(args.before), "after": ROOT}
    runs = []
    for rep in range(args.repeats):
        for arm, tree in trees.items():
            service = Service(tree, "smollm2-135m-instruct", dtype)
            try:
                for eval_items in (0, args.eval_items):
                    cmd = [sys.executable, str(ROOT / "benchmarks" / "serving_client.py"), "--url", service.url,
                           "--dtype", dtype, "--prompts", str(args.prompts), "--group-size", str(args.group_size),
                           "--eval-items", str(eval_items), "--seed", str(rep + 1)]
                    r = subprocess.run(cmd, env=_env(tree, 1), capture_output=True, text=True, cwd=tree)
                    if r.returncode != 0:
                        raise RuntimeError(f"{arm}: client exit {r.returncode}\n{r.stderr[-3000:]}")
                    result = {"arm": arm, "repeat": rep, "eval_items": eval_items,
                              **json.loads(r.stdout.strip().splitlines()[-1])}
                    _record(runs, result, args.out, {**vars(args), "dtype": dtype})
            finally:
                service.close()
    write_result(args.out, "serving", {"runs": runs, "table": stage_table(runs)}, {**vars(args), "dtype": dtype})
    print(json.dumps(stage_table(runs), indent=1))


def stage_table(runs: list[dict]) -> dict:
    def mean(arm, eval_items, key):
        values = [r[key] for r in runs if r["arm"] == arm and r["eval_items"] == eval_items and key in r]
        return sum(values) / len(values) if values else None

    out = {}
    for arm in ("before", "after"):
        solo = [r for r in runs if r["arm"] == arm and r["eval_items"] == 0]
        shared = [r for r in runs if r["arm"] == arm and r["eval_items"] > 0]
        out[arm] = {"stage_tokens_per_s": mean(arm, 0, "stage_tokens_per_s"),
                    "stage_s": mean(arm, 0, "s_stage"),
                    "shared_eval_answered_s": mean(arm, shared[0]["eval_items"], "done_at_s_eval") if shared else None,
                    "shared_all_done_s": mean(arm, shared[0]["eval_items"], "all_done_s") if shared else None,
                    "num_repeats": len(solo)}
    b, a = out["before"], out["after"]
    out["ratios_after_over_before"] = {
        k: (a[k] / b[k] if a.get(k) and b.get(k) else None)
        for k in ("stage_tokens_per_s", "stage_s", "shared_eval_answered_s", "shared_all_done_s")}
    return out


def agent(args) -> None:
    from benchmarks import async_stages

    async_stages.CACHE.mkdir(parents=True, exist_ok=True)
    async_stages.prepare_calculator()
    model = async_stages.task_model("calculator")
    ns = argparse.Namespace(updates=1, prompts=args.prompts, group_size=args.group_size, eval_items=4, engine="remote")
    overrides = [o for o in async_stages.task_overrides("calculator", ns)
                 if not o.startswith(("rollout.engine=", "rollout.dtype="))]
    dtype = "float32"  # the warm-started model was saved in float32; both sides run it so
    runs = []
    service = Service(ROOT, model, dtype)
    try:
        for rep in range(args.repeats):
            for latency in args.latencies:
                for lockstep in ("true", "false"):
                    run_dir = CACHE / f"agent_l{latency}_lock{lockstep}_r{rep}"
                    shutil.rmtree(run_dir, ignore_errors=True)
                    cmd = [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), *overrides,
                           "schedule.total_updates=1", "schedule.num_stages=1", f"train.seed={rep + 1}",
                           "rollout.engine=remote", f"rollout.remote.urls=[{service.url}]",
                           f"rollout.dtype={dtype}", f"env.lockstep={lockstep}"]
                    t0 = time.perf_counter()
                    r = subprocess.run(cmd, env=_env(ROOT, 1, MUGRPO_BENCH_TOOL_LATENCY_S=str(latency)),
                                       capture_output=True, text=True)
                    if r.returncode != 0:
                        raise RuntimeError(f"agent run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
                    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
                    st = [x for x in records if x["kind"] == "stage"][0]
                    result = {"latency_s": latency, "lockstep": lockstep == "true", "repeat": rep,
                              "process_wall_s": time.perf_counter() - t0,
                              **{k: st.get(k) for k in ("perf/generate_s", "perf/engine_busy_frac", "perf/tool_wait_s",
                                                        "env/tool_calls", "env/turns_mean", "env/num_trajectories",
                                                        "env/tool_call_frac", "reward/mean")}}
                    _record(runs, result, args.out, {**vars(args), "overrides": overrides})
    finally:
        service.close()
    write_result(args.out, "serving", {"runs": runs, "table": agent_table(runs)},
                 {**vars(args), "overrides": overrides})
    print(json.dumps(agent_table(runs), indent=1))


def agent_table(runs: list[dict]) -> dict:
    out = {}
    for latency in sorted({r["latency_s"] for r in runs}):
        row = {}
        for mode, lockstep in (("lockstep", True), ("independent", False)):
            mine = [r for r in runs if r["latency_s"] == latency and r["lockstep"] is lockstep]
            row[mode] = {k: (sum(r[k] or 0.0 for r in mine) / len(mine) if mine else None)
                         for k in ("perf/generate_s", "perf/engine_busy_frac", "perf/tool_wait_s", "env/tool_calls",
                                   "env/turns_mean")}
        lock, ind = row["lockstep"]["perf/generate_s"], row["independent"]["perf/generate_s"]
        row["generate_s_independent_over_lockstep"] = ind / lock if lock and ind else None
        out[str(latency)] = row
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks serving", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("stage", "agent"))
    p.add_argument("--before", default=BEFORE, help="the earlier commit whose hand-written service is measured")
    p.add_argument("--prompts", type=int, default=None, help="prompts of the stage (stage: 64, agent: 16)")
    p.add_argument("--group-size", type=int, default=None, help="samples per prompt (stage: 8, agent: 4)")
    p.add_argument("--eval-items", type=int, default=64, help="stage: the evaluation call sent beside it")
    p.add_argument("--latencies", type=float, nargs="+", default=[0.5, 2.0], help="agent: the tool's seconds")
    p.add_argument("--repeats", type=int, default=2)
    common_arguments(p, "serving")
    args = p.parse_args(argv)
    if args.what == "agent" and args.out == p.get_default("out"):
        args.out = str(Path(args.out).with_name("serving_agent.json"))
    args.prompts = args.prompts or (64 if args.what == "stage" else 16)
    args.group_size = args.group_size or (8 if args.what == "stage" else 4)
    CACHE.mkdir(parents=True, exist_ok=True)
    (stage if args.what == "stage" else agent)(args)


if __name__ == "__main__":
    main()
