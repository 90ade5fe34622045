"""The one runner of user code (mugrpo.rollout.calls.CallRunner) under hostile calls: hung calls never
pile up threads (a process-wide cap, then refusals, counted as errors), and with the process isolation a
call that holds the GIL (a catastrophic regex) ends at its timeout, its worker killed and replaced."""
import json
import time

import pytest

import guard_tools
from mugrpo.rollout import calls
from mugrpo.rollout.calls import CallRunner, ProcessExit
from mugrpo.rollout.envs.tools import ToolEnvironment


def tool_call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


_PILE_UP = """
import json, sys, threading, time
from mugrpo.rollout import calls
from mugrpo.rollout.calls import CallRunner
from mugrpo.rollout.envs.tools import ToolEnvironment

calls.MAX_ABANDONED = 3
release = threading.Event()

def hang(x: int) -> int:
    \"\"\"Hang until released.

    Args:
        x: Ignored.
    \"\"\"
    release.wait(60)
    return x

def call(i):
    return '<tool_call>' + json.dumps({"name": "hang", "arguments": {"x": i}}) + '</tool_call>'

env = ToolEnvironment([hang], timeout_s=0.2, runner=CallRunner(4))
before = threading.active_count()
results = [env.step(call(i)) for i in range(6)]
out = {"new_threads": threading.active_count() - before,
       "timeouts": sum(r.metadata["tool_timeouts"] for r in results),
       "refusals": sum(r.metadata["tool_exceptions"] for r in results),
       "last": results[-1].observations[0]["content"]}
release.set()
deadline = time.monotonic() + 10
while threading.active_count() > before and time.monotonic() < deadline:
    time.sleep(0.05)
out["threads_after"] = threading.active_count() - before
out["errors_after"] = env.step(call(1)).metadata["tool_errors"]
print(json.dumps(out))
"""


def test_hung_tool_calls_do_not_pile_up_threads():
    # In a fresh process: the cap is process-wide, so calls other tests abandoned would move it.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", _PILE_UP], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # 3 calls hang (the cap), the other 3 are refused at once, without a thread of their own
    assert (out["new_threads"], out["timeouts"], out["refusals"]) == (3, 3, 3)
    assert "refused" in out["last"]
    assert out["threads_after"] == 0  # the hung threads ended once released: their count went back down
    assert out["errors_after"] == 0  # calls run again


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
    assert not die.ok and "worker process died (exit code 3" in die.error and die.exited == 3
    assert isinstance(die.exception, ProcessExit) and die.exception.code == 3
    assert add.value == 4
    picky = calls_of(runner, guard_tools.raise_picky, 1)
    assert not picky.ok and "did not unpickle" in picky.error
    assert calls_of(runner, guard_tools.add, 3).value == 6  # the same worker serves on


def test_an_os_exit_on_a_call_thread_is_an_error_naming_its_caller_and_the_process_lives_on():
    from mugrpo.rollout.envs.tools import _Bound

    exits, adds = CallRunner(2).run([_Bound(guard_tools.die, {"x": 0}), _Bound(guard_tools.add, {"a": 1, "b": 1})],
                                    5.0)
    assert exits.exited == 3 and isinstance(exits.exception, ProcessExit)
    assert "die (" in str(exits.exception) and "guard_tools.py" in str(exits.exception)  # the function that called it
    assert adds.value == 2
    assert not getattr(calls._guard, "active", False)  # this thread (not a call's) would get the real os._exit


def calls_of(runner, fn, x):
    from mugrpo.rollout.envs.tools import _Bound

    args = {"x": x} if fn is not guard_tools.add else {"a": x, "b": x}
    return runner.run([_Bound(fn, args)], 5.0)[0]


def test_the_isolation_is_checked():
    with pytest.raises(ValueError, match="isolation must be one of"):
        CallRunner(1, isolation="fork")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_hung_call_never_keeps_the_process_alive_at_exit(isolation, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "hang.py"
    script.write_text(
        "import guard_tools\n"
        "from mugrpo.rollout.calls import CallRunner\n"
        "from mugrpo.rollout.envs.tools import _Bound\n"
        "if __name__ == '__main__':\n"
        f"    runner = CallRunner(2, isolation={isolation!r})\n"
        "    out = runner.run([_Bound(guard_tools.sleep, {'seconds': 120.0})], 0.5)\n"
        "    print('timed out' if out[0].timed_out else out)\n")
    root = Path(__file__).parents[2]
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": f"{root}:{root / 'tests'}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "timed out", done.stderr
    assert time.monotonic() - t0 < 30  # not the 120 s the call would take
