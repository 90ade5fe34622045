"""A tool call past its timeout is warned about once per tool: under thread isolation pointing to process
isolation, under process isolation saying the worker was killed (mugrpo.rollout.envs.tools)."""
import time

from mugrpo.rollout.calls import CallRunner
from mugrpo.rollout.envs import tools as tools_module
from mugrpo.rollout.envs.tools import ToolEnvironment


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "awake"


CALL = '<tool_call>{"name": "nap", "arguments": {"seconds": 3}}</tool_call>'


def test_a_timeout_under_thread_isolation_says_once_to_use_process(capsys, monkeypatch):
    monkeypatch.setattr(tools_module, "_warned_timeout", set())
    env = ToolEnvironment([nap], timeout_s=0.2, runner=CallRunner(2))
    for _ in range(2):
        assert env.step(CALL).metadata["tool_timeouts"] == 1
    err = capsys.readouterr().err
    assert err.count("warning: tool 'nap' ran past env.tool_timeout_s=0.2 s under env.tool_isolation=thread") == 1
    assert "Set env.tool_isolation=process" in err


def test_under_process_isolation_the_warning_says_the_worker_was_killed(capsys, monkeypatch):
    monkeypatch.setattr(tools_module, "_warned_timeout", set())
    env = ToolEnvironment([nap], timeout_s=0.2, runner=CallRunner(1, isolation="process"))
    assert env.step(CALL).metadata["tool_timeouts"] == 1
    err = capsys.readouterr().err
    assert "env.tool_isolation" not in err
    assert "warning: tool 'nap' ran past env.tool_timeout_s=0.2 s: its worker process was killed" in err
