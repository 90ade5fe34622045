"""mugrpo.rollout.calls under ``process`` isolation: workers started before the clock, so a
worker's start-up counts against no call and no environment step (``env.step_timeout_s``). The tool's
module here takes 3 s to import (tests/slow_import_tools.py): a step limited to 2 s times out when its
call must start a worker, and returns when the workers were started first."""
import json

import slow_import_tools
from mugrpo.config import load_config
from mugrpo.rollout.calls import CallRunner, run_calls
from mugrpo.rollout.envs.build import _ImportModules, start_tool_workers
from mugrpo.rollout.envs.tools import ToolEnvironment

CALL = f'<tool_call>{json.dumps({"name": "echo", "arguments": {"x": 7}})}</tool_call>'


def _step_within(env, seconds):
    return run_calls([lambda: env.step(CALL)], 1, seconds)[0]


def test_a_step_waits_for_no_worker_start_once_the_workers_are_started():
    cold = ToolEnvironment([slow_import_tools.echo], timeout_s=1.0, runner=CallRunner(2, isolation="process"))
    assert _step_within(cold, 2.0).timed_out  # the worker's 3 s start-up ran inside the 2 s step
    runner = CallRunner(2, isolation="process")
    runner.prestart(2, _ImportModules(("slow_import_tools",)))
    warm = ToolEnvironment([slow_import_tools.echo], timeout_s=1.0, runner=runner)
    r = _step_within(warm, 2.0)
    assert r.ok and r.value.observations[0]["content"] == "7" and r.value.metadata["tool_errors"] == 0


def test_thread_isolation_has_nothing_to_start():
    assert CallRunner(2).prestart(4) == 0.0
    cfg = load_config(overrides=["task.tools=[guard_tools:add]", "env.tool_isolation=thread"])
    assert start_tool_workers(cfg.task, cfg.env) is None


def test_the_run_starts_the_shared_workers_and_says_so():
    cfg = load_config(overrides=["task.tools=[guard_tools:add]", "env.tool_isolation=process", "env.max_workers=2"])
    line = start_tool_workers(cfg.task, cfg.env)
    assert line.startswith("[mugrpo] env.tool_isolation=process: 2 tool worker processes started in ")
    assert "no step (env.step_timeout_s)" in line
