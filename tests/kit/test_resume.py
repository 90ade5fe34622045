"""Kill -9 anywhere, resume, same result: bitwise-equal parameters in deterministic CPU mode."""
import fcntl
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.observability.loggers import read_metrics


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
    pytest.param("generate:6", marks=pytest.mark.slow),  # stage 1 generation, 2nd of its 4 batches (stage 0 finished and checkpointed)
    pytest.param("generate:2", marks=pytest.mark.slow),  # stage 0 generation: no checkpoint exists yet
    "update:3",            # mid-stage 0, after update 3 (last checkpoint at update 2)
    pytest.param("update:6", marks=pytest.mark.slow),  # mid-stage 1
    pytest.param("checkpoint_write:2", marks=pytest.mark.slow),  # inside the second checkpoint write, before its rename
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


def _resume(run_dir, *extra):
    return subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir), *extra], env=_env(),
                          capture_output=True, text=True)


def _copy(reference, tmp_path, drop_final=True):
    """A copy of the finished reference run (cheap: a tiny model); without final_model, resuming it
    redoes only what follows the checkpoint it loads."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    if drop_final:
        shutil.rmtree(run_dir / "final_model")
    return run_dir


def _edit_config(run_dir, key, value):
    path = run_dir / "config.yaml"
    values = yaml.safe_load(path.read_text())
    section, name = key.split(".")
    values[section][name] = value
    path.write_text(yaml.safe_dump(values, sort_keys=False))


@pytest.mark.parametrize("key,value", [("optim.lr", 1e-3), ("loss.clip_eps_high", 0.5)])
def test_edited_config_yaml_is_checked_against_the_checkpoint(tmp_path, reference, key, value):
    run_dir = _copy(reference, tmp_path)
    _edit_config(run_dir, key, value)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    r = _resume(run_dir)
    assert r.returncode == 2, r.stderr[-3000:]
    assert key in r.stderr and "ckpt_000008_s002_u00000/config.yaml" in r.stderr and "Traceback" not in r.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics and not (run_dir / "final_model").exists()


def test_resume_safe_edit_of_config_yaml_is_applied(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    _edit_config(run_dir, "train.save_final_model", False)
    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run_dir / "final_model").exists()  # the edit took effect


@pytest.mark.parametrize("content", [b"", b"optim: [1,\n", b"optim:\n  lr: 2.0e-5\xff\n", b"- a list\n",
                                     b"optim:\n  lr: fast\n"])
def test_unusable_config_yaml_gives_one_line_error_naming_it(tmp_path, reference, content):
    run_dir = _copy(reference, tmp_path)
    (run_dir / "config.yaml").write_bytes(content)
    r = _resume(run_dir)
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(run_dir / "config.yaml") in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_corrupt_newest_checkpoint_falls_back_to_an_older_one(tmp_path, reference):
    # keep_last=2 leaves ckpt 6 (stage 1, 2 updates in) and ckpt 8 (the end). Truncate ckpt 8's
    # weights: the resume must warn naming it, load ckpt 6, redo updates 7-8 from the stage data on
    # disk and end bitwise-equal to the uninterrupted run.
    run_dir = _copy(reference, tmp_path)
    newest = sorted((run_dir / "checkpoints").glob("ckpt_*"))[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoint {newest.name} cannot be loaded ({weights}" in r.stdout
    assert "resumed from ckpt_000006_s001_u00002" in r.stdout
    ref, got = _final_params(reference), _final_params(run_dir)
    assert all(ref[k].equal(got[k]) for k in ref)
    assert [r["update"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"] == list(range(1, 9))


def test_second_process_on_a_run_dir_is_refused(tmp_path, reference):
    from mugrpo.run_dir import LOCK_FILE

    run_dir = _copy(reference, tmp_path)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    with open(run_dir / LOCK_FILE, "a") as held:  # this test process plays the first trainer
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = _resume(run_dir)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "in use by another mugrpo process" in r.stderr and "Traceback" not in r.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics and not (run_dir / "final_model").exists()


def test_resume_with_another_run_dir_is_refused(tmp_path, reference):
    r = _resume(reference, "--run-dir", str(tmp_path / "elsewhere"))
    assert r.returncode == 2 and "drop --run-dir" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.slow  # ~11 s
def test_resume_removes_temporary_files_left_by_a_kill(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    stale = [run_dir / "stages" / "stage_001" / ".rollouts_rank0.safetensors.tmp-4242",
             run_dir / ".metrics.jsonl.tmp-4242", run_dir / "checkpoints" / ".tmp-ckpt_000010_s002_u00002"]
    stale[0].write_bytes(b"half a shard")
    stale[1].write_text("{")
    stale[2].mkdir()
    (stale[2] / "model.safetensors").write_bytes(b"")
    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not any(p.exists() for p in stale)
    assert f"removed {stale[0]}" in r.stdout


@pytest.mark.slow  # ~23 s
def test_truncated_stage_file_is_named_and_the_advice_works(tmp_path, reference):
    # Without ckpt 8 the resume loads ckpt 6 (stage 1, 2 updates in), which needs stage 1's data.
    run_dir = _copy(reference, tmp_path)
    shutil.rmtree(sorted((run_dir / "checkpoints").glob("ckpt_*"))[-1])
    stage = run_dir / "stages" / "stage_001"
    shard = stage / "rollouts_rank0.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    r = _resume(run_dir)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"stage data file {shard} cannot be read" in r.stderr and f"Delete the folder {stage}" in r.stderr
    assert "Traceback" not in r.stderr and not (run_dir / "final_model").exists()
    shutil.rmtree(stage)  # the advice: the stage is generated again, and the run finishes
    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "final_model" / "model.safetensors").is_file()


@pytest.mark.slow  # ~11 s; a corrupt newest checkpoint above keeps the fallback's check
def test_corrupt_trainer_state_is_named_and_an_older_checkpoint_used(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    state = sorted((run_dir / "checkpoints").glob("ckpt_*"))[-1] / "trainer_state.json"
    state.write_text('{"stage": 2, "upd')
    r = _resume(run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"({state}: " in r.stdout and "resumed from ckpt_000006_s001_u00002" in r.stdout
    ref, got = _final_params(reference), _final_params(run_dir)
    assert all(ref[k].equal(got[k]) for k in ref)


def test_no_loadable_checkpoint_is_an_error_naming_each(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    for folder in (run_dir / "checkpoints").glob("ckpt_*"):
        (folder / "trainer_state.json").write_text("")
    r = _resume(run_dir)
    assert r.returncode == 2 and "no checkpoint of" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("trainer_state.json") == 2


GENERATION_KEYS = ("reward/num_errors", "reward/num_invalid", "reward/num_timeouts", "reward/unparsable_frac",
                   "stage/num_groups_trained", "stage/num_prompts_skipped")


@pytest.mark.slow  # ~30 s; a kept kill-resume test checks the stage line's other metrics
def test_stage_line_after_a_mid_stage_resume_keeps_the_generation_metrics(tmp_path, tiny_model_dir):
    # A reward that fails on some responses, so the counts are not all 0 (else the comparison could not fail).
    flaky = ["task.reward_fn=toy_rewards:flaky", "loss.drop_zero_var_groups=true"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.run(_cmd(ref_dir, tiny_model_dir, *flaky), env=_env(), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = subprocess.run(_cmd(run_dir, tiny_model_dir, *flaky), env=_env("update:3"), capture_output=True,
                            text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    old_dir = tmp_path / "old"  # a stage folder written before the metrics were kept: resumes, without them
    shutil.copytree(run_dir, old_dir)
    (old_dir / "stages" / "stage_000" / "stage_metrics.json").unlink()
    for d in (run_dir, old_dir):
        r = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(d)], env=_env(),
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    ref_stages = [r for r in read_metrics(ref_dir / "metrics.jsonl") if r["kind"] == "stage"]
    got_stages = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"]
    assert sum(r["reward/num_errors"] + r["reward/num_invalid"] for r in ref_stages) > 0
    assert got_stages[0]["stage/resumed"] == 1.0  # stage 0 was read back, not generated again
    for ref_line, got_line in zip(ref_stages, got_stages, strict=True):
        assert {k: got_line.get(k) for k in GENERATION_KEYS} == {k: ref_line[k] for k in GENERATION_KEYS}
    old_stage0 = [r for r in read_metrics(old_dir / "metrics.jsonl") if r["kind"] == "stage"][0]
    assert old_stage0["stage/resumed"] == 1.0 and "reward/num_errors" not in old_stage0
