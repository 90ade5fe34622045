"""How long a SIGTERM during generation takes to stop a run (issue 27 item 4): a benchmark, not a test.

Runs ``mugrpo train`` on the tiny model built in code (CPU, one thread) with one long generate call
per stage (``rollout.batch_size`` = the stage's sequences, long responses), sends a real SIGTERM a
few seconds into stage 0's generation, and measures the seconds from the signal to the process's
exit. For scale it also runs the same stage uninterrupted and reports its generation seconds
(``perf/generate_s``): without the per-decode-step check a stop had to wait for the whole call.
Writes ``benchmarks/results/stop_latency.json``; never asserts on time.

    PYTHONPATH=. python -m benchmarks stop_latency [--max-new-tokens 256] [--delay-s 3]

``--default-job`` measures the README's default job instead (``mugrpo train`` with no overrides:
SmolLM2-135M-Instruct, vLLM when installed), twice: a SIGTERM during its starting evaluation
(``--eval-delay-s`` after the plan is printed) and one during stage 0's generation (``--delay-s``
after the starting evaluation's record is written). Run it with ``.venv-vllm/bin/python``; writes
``benchmarks/results/stop_latency_default.json``.

    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks stop_latency --default-job
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite import common_arguments, write_result

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _cmd(run_dir: Path, model: str, max_new_tokens: int) -> list[str]:
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model}",
            "task.few_shot=[]", "task.instruction=", "task.reward_fn=toy_rewards:frac_ones", "train.autocast=none",
            "train.progress=false", "train.threads=1", "eval.num_items=0", "schedule.total_updates=4",
            "schedule.num_stages=1", f"rollout.max_new_tokens={max_new_tokens}", "rollout.batch_size=256"]


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    for key in ("MUGRPO_DIE_AT", "MUGRPO_STOP_AT"):
        env.pop(key, None)
    return env


def stopped_run(run_dir: Path, model: str, max_new_tokens: int, delay_s: float) -> dict:
    """SIGTERM ``delay_s`` after the plan is printed (the stop handler is installed, generation starts)."""
    proc = subprocess.Popen(_cmd(run_dir, model, max_new_tokens), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the plan's last lines come right before stage 0's generation
        if "rollout engine" in line:
            break
    time.sleep(delay_s)
    t_signal = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    stop_s = time.perf_counter() - t_signal
    return {"returncode": proc.returncode, "stop_s": stop_s, "delay_s": delay_s,
            "stage_written": _stage_written(run_dir)}


def _stage_written(run_dir: Path) -> bool:
    """Whether stage 0 was completed (its marker written), as mugrpo's stage reader decides."""
    from mugrpo.run_dir import RunDir
    from mugrpo.stages.shards import is_complete

    return is_complete(RunDir(run_dir).stage(0))


def full_stage_generate_s(run_dir: Path, model: str, max_new_tokens: int) -> float:
    r = subprocess.run(_cmd(run_dir, model, max_new_tokens), env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "stage":
            return record["perf/generate_s"]
    raise RuntimeError("no stage record")


def _default_job_stop(run_dir: Path, phase: str, delay_s: float) -> dict:
    """SIGTERM to the default job in ``phase`` ("eval": the starting evaluation; "generate": stage 0's
    generation, after the starting evaluation's record); seconds from the signal to the exit."""
    cmd = [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), "train.progress=false"]
    env = {**_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    engine = ""
    for line in proc.stdout:
        if "rollout engine" in line:
            engine = line.split(None, 2)[-1].strip()
            break
    t_plan = time.perf_counter()
    if phase == "generate":
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"kind": "eval"' in metrics.read_text()):
            if proc.poll() is not None:
                raise RuntimeError(f"the default job ended (exit {proc.returncode}) before its first evaluation")
            time.sleep(0.5)
    time.sleep(delay_s)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
               if x.strip()] if (run_dir / "metrics.jsonl").exists() else []
    t_signal = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    tail = proc.communicate()[0]
    stop_s = time.perf_counter() - t_signal
    after = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"phase": phase, "rollout_engine": engine, "signal_after_s": round(t_signal - t_plan, 1),
            "records_at_signal": [r["kind"] for r in records], "records_at_exit": [r["kind"] for r in after],
            "sigterm_to_exit_s": round(stop_s, 2), "exit_code": proc.returncode,
            "stage_written": _stage_written(run_dir),
            "last_lines": tail.strip().splitlines()[-3:]}


def default_job(args) -> None:
    runs = []
    for phase, delay in (("eval", args.eval_delay_s), ("generate", args.delay_s)):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(_default_job_stop(Path(tmp) / "run", phase, delay))
            print(json.dumps(runs[-1], indent=1), flush=True)
    result = {"job": "the default job (mugrpo train, no overrides)", "runs": runs}
    out = write_result(args.out or ROOT / "benchmarks" / "results" / "stop_latency_default.json", "stop_latency",
                       result, args)
    print(f"wrote {out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--delay-s", type=float, default=3.0)
    common_arguments(p, "stop_latency")
    p.set_defaults(out=None)  # stop_latency.json, or stop_latency_default.json with --default-job
    p.add_argument("--default-job", action="store_true", help="the default job (SmolLM2, vLLM) instead")
    p.add_argument("--eval-delay-s", type=float, default=40.0,
                   help="--default-job: seconds after the plan to signal, inside the starting evaluation")
    args = p.parse_args(argv)
    if args.default_job:
        return default_job(args)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "stop_latency.json")
    sys.path.insert(0, str(ROOT))
    from mugrpo.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(Path(tmp) / "model"))
        stopped = stopped_run(Path(tmp) / "stopped", model, args.max_new_tokens, args.delay_s)
        full_s = full_stage_generate_s(Path(tmp) / "full", model, args.max_new_tokens)
    result = {"model": "tiny (built in code), CPU, 1 thread", "sequences_per_call": 256,
              "max_new_tokens": args.max_new_tokens, "sigterm_to_exit_s": round(stopped["stop_s"], 2),
              "exit_code": stopped["returncode"], "stage_written": stopped["stage_written"],
              "signal_after_plan_s": args.delay_s, "uninterrupted_stage_generate_s": round(full_s, 2)}
    write_result(args.out, "stop_latency", result, args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
