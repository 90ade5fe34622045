"""Kill -9 anywhere, resume, same result: bitwise-equal parameters in deterministic CPU mode."""
import os
import subprocess
import sys

import pytest
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.loggers import read_metrics


def _cmd(run_dir, model_dir, *extra):
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
            *TINY_OVERRIDES, "schedule.total_updates=8", "schedule.num_stages=2", "optim.lr=1e-2",
            "train.deterministic=true", "train.threads=1", "checkpoint.every_updates=2", *extra]


def _env(die_at=None):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MUGRPO_DIE_AT", None)
    env.pop("MUGRPO_STOP_AT", None)
    if die_at:
        env["MUGRPO_DIE_AT"] = die_at
    return env


def _final_params(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    r = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("die_at", [
    "generate:6",          # stage 1 generation, 2nd of its 4 batches (stage 0 finished and checkpointed)
    "generate:2",          # stage 0 generation: no checkpoint exists yet
    "update:3",            # mid-stage 0, after update 3 (last checkpoint at update 2)
    "update:6",            # mid-stage 1
    "checkpoint_write:2",  # inside the second checkpoint write, before its rename
])
def test_killed_and_resumed_run_is_bitwise_identical(tmp_path, tiny_model_dir, reference, die_at):
    run_dir = tmp_path / "run"
    killed = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env(die_at), capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]  # really died by SIGKILL
    assert not (run_dir / "final_model").exists()
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _final_params(reference), _final_params(run_dir)
    assert ref.keys() == got.keys()
    for name in ref:
        assert ref[name].equal(got[name]), name
    # The metrics log tells the same story: every update exactly once, same losses.
    ref_updates = [r for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "update"]
    got_updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert [r["update"] for r in got_updates] == list(range(1, 9))
    assert [r["loss/policy"] for r in got_updates] == [r["loss/policy"] for r in ref_updates]
    assert [r["stage"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"] == [0, 1]


def test_new_run_in_non_empty_dir_is_refused(tmp_path, tiny_model_dir, reference):
    r = subprocess.run(_cmd(reference, tiny_model_dir), env=_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "--resume" in r.stderr and "not empty" in r.stderr


def test_resume_with_incompatible_config_is_refused(reference):
    r = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(reference), "optim.lr=1e-3"],
                       env=_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "optim.lr" in r.stderr


def test_sigterm_mid_update_checkpoints_there_and_resumes_exactly(tmp_path, tiny_model_dir, reference):
    # SIGTERM lands right after update 3 of 8 (mid-stage 0; with checkpoint.every_updates=0 the only
    # checkpoint so far would be none): the run must finish that update, checkpoint at update 3, say
    # how to resume, and the resumed run must end bitwise-equal to the uninterrupted one.
    run_dir = tmp_path / "run"
    env = {**_env(), "MUGRPO_STOP_AT": "update:3"}
    stopped = subprocess.run(_cmd(run_dir, tiny_model_dir, "checkpoint.every_updates=0"), env=env,
                             capture_output=True, text=True)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "--resume" in stopped.stderr
    assert [p.name.split("_")[1] for p in (run_dir / "checkpoints").glob("ckpt_*")] == ["000003"]
    assert [r["update"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"] == [1, 2, 3]
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _final_params(reference), _final_params(run_dir)
    assert all(ref[k].equal(got[k]) for k in ref)
