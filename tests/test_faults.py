"""Deliberate process death at named points (mugrpo.faults): the signal lands on the n-th pass only
(checked in a child process), and the poison counter."""
import signal
import subprocess
import sys

import pytest

from mugrpo import faults

pytestmark = pytest.mark.unit

CHILD = ("from mugrpo import faults\n"
         "for i in range(1, 4):\n"
         "    faults.maybe_die('eval')\n"  # another point: never counted for 'update'
         "    faults.maybe_die('update')\n"
         "    print('passed', i, flush=True)\n")


def _child(env_var: str, spec: str):
    import os

    env = {**os.environ, env_var: spec}
    for other in faults.VARIABLES:
        if other != env_var:
            env.pop(other, None)
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)


def test_stop_at_sends_sigterm_on_the_nth_pass_only():
    proc = _child("MUGRPO_STOP_AT", "update:2")
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["passed 1"]  # died in the 2nd pass, before printing it


def test_die_at_sends_sigkill_and_an_empty_count_means_the_first():
    proc = _child("MUGRPO_DIE_AT", "update")
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout == ""


def test_hang_at_blocks_only_the_thread_that_passes_the_point(monkeypatch):
    import threading

    monkeypatch.setattr(faults, "_counts", {})
    for var in faults.VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MUGRPO_HANG_AT", "update:2")
    passes = []

    def worker():
        for i in range(1, 4):
            faults.maybe_die("update")
            passes.append(i)

    t = threading.Thread(target=worker, daemon=True)  # left blocked for good: a daemon, so pytest exits
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive() and passes == [1]  # stuck in its 2nd pass; this thread goes on
    assert faults._counts == {"MUGRPO_HANG_AT:update": 2}


def test_a_point_not_listed_never_fires():
    proc = _child("MUGRPO_STOP_AT", "checkpoint_write:1,update:9")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["passed 1", "passed 2", "passed 3"]


def test_should_poison_counts_the_point_and_fires_on_the_nth(monkeypatch):
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("MUGRPO_POISON_AT", "loss:2")
    assert [faults.should_poison("loss") for _ in range(4)] == [False, True, False, False]
    assert not faults.should_poison("grad")  # another point: not counted
    assert faults._counts == {"poison:loss": 4}


def test_should_poison_every_time_and_off_without_the_variable(monkeypatch):
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("MUGRPO_POISON_AT", "loss:*")
    assert [faults.should_poison("loss") for _ in range(3)] == [True, True, True]
    monkeypatch.delenv("MUGRPO_POISON_AT")
    assert not faults.should_poison("loss")


def test_maybe_die_without_its_variables_does_nothing(monkeypatch):
    monkeypatch.setattr(faults, "_counts", {})
    for var in faults.VARIABLES:
        monkeypatch.delenv(var, raising=False)
    faults.maybe_die("update")
    assert faults._counts == {}
