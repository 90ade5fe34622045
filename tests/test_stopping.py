"""Stopping on SIGINT/SIGTERM (mugrpo.stopping): a signal sets ``requested``, check() raises the
message that names the resume command, hold() nests and restores the previous handler."""
import os
import signal

import pytest

from mugrpo import stopping
from mugrpo.run_dir import RunDir
from mugrpo.stopping import GracefulStop, Interrupted

pytestmark = pytest.mark.unit


def test_sigterm_sets_requested_and_check_raises_with_the_sft_resume_command(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).write_kind("sft")
    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop(run)
    try:
        stop.check()  # nothing requested yet
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        with pytest.raises(Interrupted) as info:
            stop.check()
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    assert str(info.value) == f"training stopped cleanly and checkpointed. Resume with: mugrpo sft --resume {run}"
    assert info.value.run_dir == run
    assert "SIGTERM received: stopping at the next safe point" in capsys.readouterr().out


def test_a_stop_before_the_run_dir_says_nothing_was_written():
    err = Interrupted(None)
    assert str(err) == "stopped before the run wrote anything; run the same command again to start it"
    assert err.run_dir is None


def test_the_kind_given_beats_the_recorded_one(tmp_path):
    # a warm start inside a train run resumes with the parent run's command
    assert str(Interrupted(tmp_path / "run" / "warmstart", "warmstart")).endswith(
        f"mugrpo train --resume {tmp_path / 'run'}")


def test_hold_nests_and_restores_the_previous_handler():
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert stopping.current() is None
    stopping.check()  # outside a hold: nothing to check
    with stopping.hold() as outer:
        assert stopping.current() is outer
        assert signal.getsignal(signal.SIGTERM) == outer._handle
        with stopping.hold() as inner:
            assert inner is outer  # the held one, not a new one
        assert signal.getsignal(signal.SIGTERM) == outer._handle  # the inner block restored nothing
        outer.requested = True
        with pytest.raises(Interrupted, match="stopped before the run wrote anything"):
            stopping.check()
    assert stopping.current() is None
    assert signal.getsignal(signal.SIGINT) is before_int and signal.getsignal(signal.SIGTERM) is before_term
