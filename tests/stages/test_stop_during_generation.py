"""SIGTERM during generation: the stop lands inside the generate call (between the
HF engine's decode steps), the stage's samples are discarded (no stage data, no checkpoint past the
stage start), and the resume is bitwise-equal to an uninterrupted run; a second SIGTERM aborts at
once. Real subprocess runs of the tiny model, stops placed by ``MUGRPO_STOP_AT`` (never by timing)."""
import subprocess
import sys

import pytest
from conftest import TINY_OVERRIDES
from kit.test_resume import _env, _final_params

from mugrpo.observability.loggers import read_metrics

# One generate call per stage (32 prompts x G = 8 = 256 sequences): before the stop was checked
# between decode steps, a SIGTERM here waited for the whole stage's generation.
ONE_CALL = "rollout.batch_size=256"


def _cmd(run_dir, model_dir, *extra):
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
            *TINY_OVERRIDES, "schedule.total_updates=8", "schedule.num_stages=2", "optim.lr=1e-2",
            "train.deterministic=true", "train.threads=1", "checkpoint.every_updates=2", ONE_CALL, *extra]


def _run(cmd, stop_at=None):
    env = _env()
    if stop_at:
        env["MUGRPO_STOP_AT"] = stop_at
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def _resume(run_dir):
    return _run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)])


@pytest.fixture(scope="module")
def one_call_reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    r = _run(_cmd(run_dir, tiny_model_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _assert_same_run(reference, run_dir):
    ref, got = _final_params(reference), _final_params(run_dir)
    assert ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
    updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert [r["update"] for r in updates] == list(range(1, 9))
    assert [r["loss/policy"] for r in updates] == [
        r["loss/policy"] for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "update"]


def test_sigterm_inside_a_generate_call_stops_there_and_the_resume_is_bitwise(tmp_path, tiny_model_dir,
                                                                              one_call_reference):
    # The SIGTERM lands after decode step 2 of stage 0's only generate call (8 steps at most).
    run_dir = tmp_path / "run"
    stopped = _run(_cmd(run_dir, tiny_model_dir), stop_at="decode:2")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "SIGTERM received" in stopped.stdout and f"mugrpo train --resume {run_dir}" in stopped.stderr
    # The samples generated so far are discarded: no stage data, no checkpoint, no update.
    assert not list((run_dir / "stages").glob("stage_*/shards.json"))
    assert not list((run_dir / "checkpoints").glob("ckpt_*"))
    assert not [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    resumed = _resume(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(one_call_reference, run_dir)


@pytest.mark.slow  # ~24 s
def test_a_second_sigterm_aborts_at_once_and_the_run_still_resumes(tmp_path, tiny_model_dir, one_call_reference):
    # The first SIGTERM lands after update 3; the second inside the checkpoint it asked for (the
    # second checkpoint write: the first is update 2's). The process must not finish that write.
    run_dir = tmp_path / "run"
    aborted = _run(_cmd(run_dir, tiny_model_dir), stop_at="update:3,checkpoint_write:2")
    assert aborted.returncode == -15, aborted.stderr[-3000:]  # ended by SIGTERM itself, not exit 130
    assert "second SIGTERM: aborting at once" in aborted.stdout
    assert f"mugrpo train --resume {run_dir}" in aborted.stdout
    assert [p.name for p in (run_dir / "checkpoints").glob("ckpt_*")] == ["ckpt_000002_s000_u00002"]
    resumed = _resume(run_dir)  # removes the partial checkpoint, resumes from update 2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ".tmp-ckpt_000003" in resumed.stdout
    _assert_same_run(one_call_reference, run_dir)


MULTI_TURN = ["task.env=multiturn_envs:TryAgain", "rollout.max_new_tokens=12"]


@pytest.fixture(scope="module")
def env_reference(tmp_path_factory, tiny_model_dir):
    from kit.test_resume import _cmd as plain_cmd

    run_dir = tmp_path_factory.mktemp("env_ref") / "run"
    r = _run(plain_cmd(run_dir, tiny_model_dir, *MULTI_TURN))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, plain_cmd


@pytest.mark.slow  # ~30 s; the single-turn case is kept
def test_sigterm_inside_a_multi_turn_policy_turn_stops_there_and_the_resume_is_bitwise(tmp_path, tiny_model_dir,
                                                                                       env_reference):
    # Stage 0, inside the first policy turn's engine call (decode step 3): the trajectories so far
    # (their environments closed) are discarded and the stage is rolled out again on resume.
    reference, plain_cmd = env_reference
    run_dir = tmp_path / "run"
    stopped = _run(plain_cmd(run_dir, tiny_model_dir, *MULTI_TURN), stop_at="decode:3")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert not list((run_dir / "stages").glob("stage_*/shards.json"))
    resumed = _resume(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(reference, run_dir)
