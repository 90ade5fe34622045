"""What a tool call costs under each isolation of the one runner (mugrpo.rollout.calls.CallRunner):
``thread`` (a daemon thread per call) and ``process`` (a reused worker process per running call, the
call and its result pickled), and what a timeout costs under ``process`` (the worker killed, a fresh
one started on the next call); and what an environment costs under each ``env.step_isolation``
(``thread``: made and stepped in this process, on the loop's call threads; ``process``: a
:class:`~mugrpo.rollout.envs.isolated.ProcessEnvironment`, made in a worker forked by the fork
server, every call a pickle round trip), for the built-in calculator agent (a step that parses a
``<tool_call>`` and runs ``calculate``) and the skyrl-gym ``gsm8k`` environment: the first
environment (the fork server's start), each further one (made and reset), and a step.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m benchmarks call_isolation --calls 200

Writes benchmarks/results/call_isolation.json in the suite's schema (:mod:`benchmarks.suite`). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import multiprocessing.forkserver
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test suite's tools (guard_tools)

import guard_tools  # noqa: E402
from benchmarks.suite import common_arguments, write_result  # noqa: E402
import functools  # noqa: E402

from mugrpo.rollout.calls import CallRunner  # noqa: E402
from mugrpo.rollout.envs.builtin import CalculatorEnvironment, SkyRLGymEnvironment  # noqa: E402
from mugrpo.rollout.envs.isolated import ProcessEnvironment  # noqa: E402
from mugrpo.rollout.envs.tools import _Bound  # noqa: E402
from mugrpo.rollout.tasks import Item  # noqa: E402

ENVIRONMENTS = {
    "calculator": (functools.partial(CalculatorEnvironment),
                   '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * (3 + 4) - 5 / 2"}}</tool_call>'),
    "skyrl_gym gsm8k": (functools.partial(SkyRLGymEnvironment, "gsm8k"), "The answer is #### 72"),
}


def per_call_s(runner: CallRunner, calls: int, batch: int, fn, args: dict) -> float:
    """Seconds per call, ``batch`` calls per ``run`` (a step's tool calls run together)."""
    runner.run([_Bound(fn, args)] * batch, 30.0)  # warm: the workers exist
    t0 = time.perf_counter()
    for _ in range(calls // batch):
        out = runner.run([_Bound(fn, args)] * batch, 30.0)
        assert all(r.ok for r in out), out
    return (time.perf_counter() - t0) / (calls // batch * batch)


def timeout_cost_s(repeats: int) -> dict:
    """Under ``process``: a call killed at a 0.2 s timeout, then the next (cold) call's seconds."""
    runner = CallRunner(1, isolation="process")
    runner.run([_Bound(guard_tools.add, {"a": 1, "b": 1})], 30.0)
    killed, next_call = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.run([_Bound(guard_tools.backtrack, {"n": 30})], 0.2)
        killed.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        runner.run([_Bound(guard_tools.add, {"a": 1, "b": 1})], 30.0)
        next_call.append(time.perf_counter() - t0)
    return {"timed_out_call_s": statistics.median(killed), "next_call_after_kill_s": statistics.median(next_call)}


def environment_cost(factory, action: str, isolation: str, envs: int, steps: int) -> dict:
    """Seconds to make and reset an environment (the first, and the median of the next ``envs``) and a
    step's median (``steps`` steps, each through a one-slot call runner, as the rollout loop runs them)."""
    item = Item("Natalia sold 48 clips in April and half as many in May. How many in all?", "72")
    make = factory if isolation == "thread" else functools.partial(ProcessEnvironment, factory, 30.0, 60.0)
    runner = CallRunner(1)
    made = []
    for _ in range(envs + 1):
        t0 = time.perf_counter()
        env = runner.run([make], 60.0)[0].value
        env.reset(item, 0)
        made.append(time.perf_counter() - t0)
        if len(made) <= envs:
            env.close()
    step_s = []
    for _ in range(steps):
        env.reset(item, 0)
        t0 = time.perf_counter()
        result = runner.run([functools.partial(env.step, action)], 30.0)[0]
        step_s.append(time.perf_counter() - t0)
        assert result.ok, result.error
    env.close()
    if isolation == "process":  # a run has one environment class: the next one gets a fork server of its own
        multiprocessing.forkserver._forkserver._stop()  # private (CPython 3.8+), as the stdlib's own tests use it
    return {"first_env_s": made[0], "env_start_s": statistics.median(made[1:]), "step_s": statistics.median(step_s)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    common_arguments(parser, "call_isolation")
    args = parser.parse_args(argv)
    rows = []
    for isolation in ("thread", "process"):
        for batch in (1, 8):
            runner = CallRunner(8, isolation=isolation)
            for name, fn, fn_args in (("add", guard_tools.add, {"a": 1, "b": 2}),
                                      ("sleep_1ms", guard_tools.sleep, {"seconds": 0.001})):
                rows.append({"isolation": isolation, "calls_per_run": batch, "tool": name,
                             "per_call_s": per_call_s(runner, args.calls, batch, fn, fn_args)})
                print(rows[-1], flush=True)
    env_rows = []
    for name, (factory, action) in ENVIRONMENTS.items():
        for isolation in ("thread", "process"):
            env_rows.append({"environment": name, "step_isolation": isolation,
                             **environment_cost(factory, action, isolation, envs=10, steps=args.calls // 4)})
            print(env_rows[-1], flush=True)
    result = {"rows": rows, "environments": env_rows, "process_timeout": timeout_cost_s(5),
              "note": "2 shared cores, other jobs running: relative, not absolute, numbers"}
    print(result["process_timeout"])
    write_result(args.out, "call_isolation", result, args, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))


if __name__ == "__main__":
    main()
