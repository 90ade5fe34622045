"""The calculator agent against one rollout service, lock-step against independent trajectories: per stage the
generation time, the engine's busy fraction as the loop sees it, the tool wait and the steps that overlapped
generation (docs/MULTITURN.md), with the tool behind a wait of ``--latency`` seconds (a sandbox, an API).

    PYTHONPATH=. .venv/bin/python -m benchmarks multiturn_modes --url http://127.0.0.1:8100 --latency 0.5 2

``--url``: a running ``mugrpo serve`` (vLLM's server for the issue's figures); without it an HF service of
``--model`` is started here. Each arm rolls out the same ``--prompts`` x ``--group-size`` trajectories
(``roll_out_items`` with the calculator environment, ``--stages`` times with the stage's seeds) through
the remote engine; independent trajectories need the engine's ``concurrent`` (the result records it: an
engine without it runs both arms lock-step). Writes benchmarks/results/multiturn_modes.json (the suite's
schema). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

from benchmarks.suite import common_arguments, write_result

PERF = ("perf/engine_busy_frac", "perf/tool_wait_s", "perf/num_overlapped_steps")


def slow_calculator(latency_s: float):
    """The calculator environment whose tool answers after ``latency_s`` (same name, schema and docstring)."""
    from mugrpo.rollout.envs.builtin import calculate
    from mugrpo.rollout.envs.tools import ToolEnvironment

    @functools.wraps(calculate)
    def slow_calculate(*args, **kwargs):
        time.sleep(latency_s)
        return calculate(*args, **kwargs)

    return lambda: ToolEnvironment([slow_calculate], max_turns=3, timeout_s=latency_s + 10.0)


def run_arm(engine, tok, latency_s: float, lockstep: bool, args) -> dict:
    from mugrpo.config import TaskConfig
    from mugrpo.rollout.engines.base import SamplingConfig
    from mugrpo.rollout.multiturn import LoopContext, LoopLimits, loop_metrics, roll_out_items
    from mugrpo.rollout.tasks import Item
    from mugrpo.seeds import derive

    items = [Item(f"What is {101 + 7 * i} * {13 + i} + {250 + 3 * i}?", str((101 + 7 * i) * (13 + i) + 250 + 3 * i))
             for i in range(args.prompts)]
    limits = LoopLimits(max_turns=3, max_response_tokens=args.max_new_tokens, step_timeout_s=latency_s + 20.0,
                        max_workers=args.prompts * args.group_size, lockstep=lockstep)
    ctx = LoopContext(engine, tok, limits, TaskConfig(instruction="Use the calculate tool, then put your final "
                                                                  "answer within \\boxed{}.", few_shot=[]))
    stages = []
    for stage in range(args.stages):
        seed = derive(0, "benchmark-multiturn-modes", stage)
        t0 = time.perf_counter()
        _, _, trajs = roll_out_items(ctx, slow_calculator(latency_s), items,
                                     SamplingConfig(n=args.group_size, max_new_tokens=args.max_new_tokens, seed=seed),
                                     reset_seed=seed)
        m = loop_metrics(trajs)
        stages.append({"generate_s": round(time.perf_counter() - t0, 3), **{k: round(m[k], 4) for k in PERF},
                       "tool_calls": m.get("env/tool_calls", 0.0), "turns_mean": round(m["env/turns_mean"], 3)})
    return {"latency_s": latency_s, "mode": "lockstep" if lockstep or not ctx.independent else "independent",
            "stages": stages}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running mugrpo serve; default: start an HF service of --model")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--latency", type=float, nargs="+", default=[0.5, 2.0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=256)
    common_arguments(p, "multiturn_modes")
    args = p.parse_args(argv)
    from mugrpo.config import load_config
    from mugrpo.models.loading import load_tokenizer, resolve_model_path
    from mugrpo.rollout.engines import make_engine

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    service = None if args.url else _start_service(path)
    url = args.url or service[1]
    try:
        rollout = load_config(None, None, ["rollout.engine=remote", f"rollout.remote.urls=[{url}]",
                                           "rollout.dtype=float32"]).rollout
        engine = make_engine("remote", path, tok, rollout)
        rows = []
        for latency in args.latency:
            for lockstep in (True, False):
                rows.append(run_arm(engine, tok, latency, lockstep, args))
                print(json.dumps(rows[-1]))
                write_result(args.out, "multiturn_modes", {
                    "rows": rows, "engine_concurrent": getattr(engine, "concurrent", False) is True, "url": url},
                    args, finished=len(rows) == 2 * len(args.latency))
        engine.close()
    finally:
        if service is not None:
            service[0].kill()
            service[0].wait()


def _start_service(model_path: str):
    """``mugrpo serve --engine hf`` on a free port: (process, url)."""
    import re
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "mugrpo", "serve", "--engine", "hf", "--model", model_path,
                             "--port", "0", "--dtype", "float32"], stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        found = re.search(r"listening on (http://\S+)", line)
        if found:  # the rest of its output is read (and dropped) so that it never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, found.group(1)
    raise RuntimeError("mugrpo serve did not start")
