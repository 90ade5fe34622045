"""Replay end to end (tiny model, CPU, deterministic): a run that replays another run's stage 0 makes
bitwise the same updates as the original; a killed replay resumes to the same result; the CLI flag and
the API argument reach the trainer; IcePop without trainer log-probs is refused at start."""

import os
import subprocess
import sys

import pytest
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.observability.loggers import read_metrics

ONE_STAGE = ["schedule.total_updates=4", "schedule.num_stages=1", "optim.lr=1e-2", "train.deterministic=true",
             "train.threads=1", "checkpoint.every_updates=1"]


def _cmd(run_dir, model_dir, *extra):
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
            *TINY_OVERRIDES, *ONE_STAGE, *extra]


def _env(die_at=None):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MUGRPO_DIE_AT", None)
    if die_at:
        env["MUGRPO_DIE_AT"] = die_at
    return env


def _run(cmd, die_at=None):
    return subprocess.run(cmd, env=_env(die_at), capture_output=True, text=True)


def _updates(run_dir):
    drop = ("time_s", "perf/update_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run_dir / "metrics.jsonl")
            if r["kind"] == "update"]


def _params(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.fixture(scope="module")
def original(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("orig") / "run"
    r = _run(_cmd(run_dir, tiny_model_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _assert_same_run(a, b):
    assert _updates(a) == _updates(b)  # every metric of every update, bitwise (floats as written)
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].equal(pb[name]), name


def test_a_replayed_stage_gives_bitwise_the_same_updates(tmp_path, tiny_model_dir, original):
    run_dir = tmp_path / "replayed"
    r = _run(_cmd(run_dir, tiny_model_dir, "--replay", str(original)))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_run(original, run_dir)
    stage = [s for s in read_metrics(run_dir / "metrics.jsonl") if s["kind"] == "stage"][0]
    assert stage["stage/replayed"] == 1.0 and "perf/generate_s" not in stage  # nothing was generated


@pytest.mark.slow  # ~15 s
def test_a_killed_replay_resumes_to_the_same_result(tmp_path, tiny_model_dir, original):
    run_dir = tmp_path / "replayed"
    killed = _run(_cmd(run_dir, tiny_model_dir, "--replay", str(original)), die_at="update:2")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(original, run_dir)


@pytest.mark.slow  # ~18 s
def test_a_replay_with_another_correction_trains_on_the_same_data(tmp_path, tiny_model_dir, original):
    run_dir = tmp_path / "opsm"
    r = _run(_cmd(run_dir, tiny_model_dir, "loss.correction=opsm", "--replay", str(original)))
    assert r.returncode == 0, r.stderr[-3000:]
    ups = _updates(run_dir)
    assert all("loss/opsm_masked_seq_frac" in u for u in ups)
    # update 0 is on-policy (pi_theta = pi_b, k1 ~ 0 < delta): nothing masked, the original's loss exactly
    assert ups[0]["loss/opsm_masked_seq_frac"] == 0.0
    assert ups[0]["loss/total"] == _updates(original)[0]["loss/total"]


def test_icepop_without_trainer_logprobs_is_refused_at_start(tmp_path, tiny_model_dir):
    r = _run(_cmd(tmp_path / "run", tiny_model_dir, "loss.correction=icepop"))
    assert r.returncode == 2
    assert "loss.behavior_logprobs=trainer" in r.stderr and "loss.correction" in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_replay_source_is_refused_at_start(tmp_path, tiny_model_dir, original):
    r = _run(_cmd(tmp_path / "run", tiny_model_dir, "rollout.group_size=2", "--replay", str(original)))
    assert r.returncode == 2
    assert "rollout.group_size" in r.stderr and "replay source" in r.stderr


def test_the_api_argument_replays_too(tmp_path, tiny_model_dir, original, monkeypatch):
    import mugrpo
    from mugrpo.config import load_config

    monkeypatch.syspath_prepend(str(TESTS))
    cfg = load_config(overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES, *ONE_STAGE])
    result = mugrpo.train(cfg, run_dir=tmp_path / "api", replay=original)
    _assert_same_run(original, result.run_dir)


ENV = ["task.env=multiturn_envs:TryAgain", "rollout.max_new_tokens=12"]


@pytest.mark.slow  # ~58 s
def test_a_replayed_multi_turn_stage_gives_bitwise_the_same_updates(tmp_path, tiny_model_dir):
    """An environment's stage (policy and env turns interleaved, turn ids stored) replays like any
    other: the same updates, per-turn veto keys included; a replay without the environment is refused."""
    source = tmp_path / "source"
    r = _run(_cmd(source, tiny_model_dir, *ENV))
    assert r.returncode == 0, r.stderr[-3000:]
    replayed = tmp_path / "replayed"
    r = _run(_cmd(replayed, tiny_model_dir, *ENV, "--replay", str(source)))
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_run(source, replayed)
    assert any(k.startswith("loss/veto_token_frac_turn") for k in _updates(replayed)[0])  # a multi-turn stage
    stage = [s for s in read_metrics(replayed / "metrics.jsonl") if s["kind"] == "stage"][0]
    assert stage["stage/replayed"] == 1.0 and "perf/generate_s" not in stage
    refused = _run(_cmd(tmp_path / "no_env", tiny_model_dir, "rollout.max_new_tokens=12", "--replay", str(source)))
    assert refused.returncode == 2
    assert "task.env" in refused.stderr and "replay source" in refused.stderr
