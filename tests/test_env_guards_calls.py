"""The one runner of user code (mugrpo.rollout.calls.CallRunner) under hostile calls: hung calls never
pile up threads (a process-wide cap, then refusals, counted as errors), and with the process isolation a
call that holds the GIL (a catastrophic regex) ends at its timeout, its worker killed and replaced."""
import json
import threading
import time

import pytest

import guard_tools
from mugrpo.rollout import calls
from mugrpo.rollout.calls import CallRunner
from mugrpo.rollout.envs.tools import ToolEnvironment


def tool_call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_hung_tool_calls_do_not_pile_up_threads(monkeypatch):
    monkeypatch.setattr(calls, "MAX_ABANDONED", calls.abandoned_calls() + 3)
    release = threading.Event()

    def hang(x: int) -> int:
        """Hang until released.

        Args:
            x: Ignored.
        """
        release.wait(60)
        return x

    env = ToolEnvironment([hang], timeout_s=0.2, runner=CallRunner(4))
    before = threading.active_count()
    try:
        results = [env.step(tool_call("hang", x=i)) for i in range(6)]
        # 3 calls hang (the cap), the other 3 are refused at once, without a thread of their own
        assert threading.active_count() - before == 3
        counts = [r.metadata for r in results]
        assert sum(c["tool_timeouts"] for c in counts) == 3 and sum(c["tool_exceptions"] for c in counts) == 3
        assert "refused" in results[-1].observations[0]["content"]
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before  # the hung threads ended: their count went back down
    assert env.step(tool_call("hang", x=1)).metadata["tool_errors"] == 0  # calls run again


def test_a_call_holding_the_gil_ends_at_its_timeout_under_the_process_isolation():
    runner = CallRunner(2, isolation="process")
    env = ToolEnvironment([guard_tools.backtrack, guard_tools.add], timeout_s=1.0, runner=runner)
    assert env.step(tool_call("add", a=1, b=2)).observations[0]["content"] == "3"  # the worker started
    t0 = time.monotonic()
    result = env.step(tool_call("backtrack", n=30))  # about 2**30 steps of backtracking: minutes
    took = time.monotonic() - t0
    assert result.metadata["tool_timeouts"] == 1 and "did not return within 1 s" in result.observations[0]["content"]
    assert took < 5
    # a fresh worker replaces the killed one
    assert env.step(tool_call("add", a=2, b=2)).observations[0]["content"] == "4"


def test_process_isolation_reports_exceptions_and_a_dead_worker_as_errors():
    runner = CallRunner(1, isolation="process")
    out = runner.run([lambda: 1], 5.0)[0]  # a lambda does not pickle: an error of that call
    assert not out.ok and "pickle" in out.error.lower()
    fail, die, add = (calls_of(runner, fn, x) for fn, x in ((guard_tools.fail, 1), (guard_tools.die, 0),
                                                             (guard_tools.add, 2)))
    assert isinstance(fail.exception, ValueError) and "bad x 1" in fail.error
    assert not die.ok and "worker process died (exit code 3)" in die.error
    assert add.value == 4


def calls_of(runner, fn, x):
    from mugrpo.rollout.envs.tools import _Bound

    args = {"x": x} if fn is not guard_tools.add else {"a": x, "b": x}
    return runner.run([_Bound(fn, args)], 5.0)[0]


def test_the_isolation_is_checked():
    with pytest.raises(ValueError, match="isolation must be one of"):
        CallRunner(1, isolation="fork")
