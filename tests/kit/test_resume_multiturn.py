"""Kill -9 during a multi-turn stage (between turns, inside an environment step), resume, same
result: bitwise-equal parameters in deterministic CPU mode (the single-turn cases: test_resume.py)."""
import subprocess
import sys

import pytest
from kit.test_resume import _cmd, _env, _final_params

from mugrpo.observability.loggers import read_metrics

ENV = ["task.env=multiturn_envs:TryAgain", "rollout.max_new_tokens=12"]


@pytest.fixture(scope="module")
def env_reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("env_ref") / "run"
    r = subprocess.run(_cmd(run_dir, tiny_model_dir, *ENV), env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("die_at, stage_0_done", [
    # stage 0, after its second policy turn, before its env steps (no checkpoint yet)
    pytest.param("turn:2", False, marks=pytest.mark.slow),
    pytest.param("turn:4", True, marks=pytest.mark.slow),  # stage 1, mid-trajectories (stage 0 took 3 turns)
    pytest.param("env_step:40", False, marks=pytest.mark.slow),  # inside an environment step (a tool call) of stage 0
])
def test_killed_mid_trajectory_and_resumed_run_is_bitwise_identical(tmp_path, tiny_model_dir, env_reference, die_at,
                                                                     stage_0_done):
    run_dir = tmp_path / "run"
    killed = subprocess.run(_cmd(run_dir, tiny_model_dir, *ENV), env=_env(die_at), capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run_dir / "stages" / "stage_000" / "shards.json").exists() == stage_0_done  # where it died
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _final_params(env_reference), _final_params(run_dir)
    for name in ref:
        assert ref[name].equal(got[name]), name
    ref_stages = [r for r in read_metrics(env_reference / "metrics.jsonl") if r["kind"] == "stage"]
    got_stages = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"]
    assert [r["env/num_done"] for r in got_stages] == [r["env/num_done"] for r in ref_stages]
