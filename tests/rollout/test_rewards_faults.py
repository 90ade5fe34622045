"""Faults are survived and counted; bad start-up input ends in exit code 2 with a message naming the fix."""
import os
import shutil
import subprocess
import sys

import pytest
from conftest import TESTS, TINY_OVERRIDES

from mugrpo.observability.loggers import read_metrics


def _run(run_dir, model_dir, *extra, env_extra=None):
    cmd = [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
           *TINY_OVERRIDES, "schedule.total_updates=4", "schedule.num_stages=2", "optim.lr=1e-2",
           "train.threads=1", "eval.num_items=0", *extra]
    env = {**os.environ, "PYTHONPATH": str(TESTS), **(env_extra or {})}
    env.pop("MUGRPO_DIE_AT", None)
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def _records(run_dir, kind):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


def test_a_nan_loss_skips_that_update_and_training_continues(tmp_path, tiny_model_dir):
    r = _run(tmp_path / "run", tiny_model_dir, env_extra={"MUGRPO_POISON_AT": "loss:2"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "update 2 skipped: non-finite loss" in r.stdout + r.stderr  # numbered as the metrics' update
    updates = _records(tmp_path / "run", "update")
    assert [u["optim/skipped"] for u in updates] == [0.0, 1.0, 0.0, 0.0]
    assert updates[1]["update"] == 2
    assert updates[-1]["optim/num_skipped_updates"] == 1
    assert all(u["loss/policy"] is not None for u in updates[2:])  # finite again after the skip


@pytest.mark.slow  # ~20 s
def test_consecutive_non_finite_updates_stop_the_run_with_advice(tmp_path, tiny_model_dir):
    # lr 1e30 throws the weights to inf on the first step; every later loss is NaN.
    r = _run(tmp_path / "run", tiny_model_dir, "optim.lr=1e30", "checkpoint.max_bad_updates=2")
    assert r.returncode == 2
    assert "2 consecutive updates had a non-finite loss" in r.stderr and "optim.lr" in r.stderr


def test_reward_function_that_raises_is_counted_and_reported_once(tmp_path, tiny_model_dir):
    r = _run(tmp_path / "run", tiny_model_dir, "task.reward_fn=toy_rewards:raises")
    assert r.returncode == 0, r.stderr[-2000:]
    stages = _records(tmp_path / "run", "stage")
    assert [s["reward/num_errors"] for s in stages] == [128, 128]  # mu 2 x 8 prompts = 16 prompts x G 8 per stage
    assert stages[0]["stage/zero_var_group_frac"] == 1.0  # every reward 0: all groups zero variance
    assert (r.stdout + r.stderr).count("RuntimeError: boom") == 2  # first traceback, once per stage
    assert "every group has zero reward variance" in r.stdout + r.stderr
    assert "stage 0: all 128 rewards failed and scored 0 (128 errors, 0 timeouts, 0 invalid values)" in r.stdout


@pytest.mark.slow  # ~20 s; os._exit below keeps the check
def test_reward_function_that_calls_sys_exit_is_an_error_not_the_end_of_the_run(tmp_path, tiny_model_dir):
    r = _run(tmp_path / "run", tiny_model_dir, "task.reward_fn=toy_rewards:exits")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [s["reward/num_errors"] for s in _records(tmp_path / "run", "stage")] == [128, 128]
    assert "SystemExit" in r.stdout and "all 128 rewards failed" in r.stdout
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()


@pytest.mark.slow  # ~19 s
def test_a_run_whose_updates_were_all_skipped_fails_without_a_final_model(tmp_path, tiny_model_dir):
    r = _run(tmp_path / "run", tiny_model_dir, env_extra={"MUGRPO_POISON_AT": "loss:*"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "mugrpo: error: all 4 updates of this run were skipped" in r.stderr and "Traceback" not in r.stderr
    assert [u["optim/skipped"] for u in _records(tmp_path / "run", "update")] == [1.0] * 4
    assert not (tmp_path / "run" / "final_model").exists()


@pytest.mark.parametrize("extra,needle", [
    (["model.name=/nonexistent/model"], "does not exist"),
    pytest.param(["task.max_prompt_tokens=5"], "longer than task.max_prompt_tokens=5", marks=pytest.mark.slow),
    pytest.param(["task.max_prompt_tokens=5", "task.prompt_too_long=skip"], "every training prompt is longer",
                 marks=pytest.mark.slow),
    pytest.param(["task.kind=math", "task.name=/nonexistent.jsonl"], "does not exist", marks=pytest.mark.slow),
])
def test_start_up_errors(tmp_path, tiny_model_dir, extra, needle):
    r = _run(tmp_path / "run", tiny_model_dir, *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and "Traceback" not in r.stderr
    # Nothing to resume was written (the prompt errors come in stage 0, after the run dir was made):
    # the corrected command can simply be run again.
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # ~12 s
def test_run_dir_not_writable(tmp_path, tiny_model_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = _run(blocker / "run", tiny_model_dir)
    assert r.returncode == 2 and "not writable" in r.stderr


@pytest.mark.slow  # ~13 s
def test_truncated_prompts_train(tmp_path, tiny_model_dir):
    from mugrpo.stages.data import StageData

    r = _run(tmp_path / "run", tiny_model_dir, "task.max_prompt_tokens=12", "task.prompt_too_long=truncate")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(_records(tmp_path / "run", "update")) == 4
    # Every stored prompt was cut to the limit (the chat-rendered questions are all longer than 12).
    data = StageData.load(tmp_path / "run" / "stages" / "stage_000" / "rollouts_rank0.safetensors")
    assert {len(p) for p in data.prompts} == {12}


def test_an_engine_that_cannot_start_leaves_no_run_dir(tmp_path, tiny_model_dir):
    # The test environment has no vLLM: the start fails before the run directory exists, so the
    # same command with rollout.engine=hf simply works.
    r = _run(tmp_path / "run", tiny_model_dir, "rollout.engine=vllm")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "rollout.engine=vllm needs vLLM" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def _broken_model(tmp_path, tiny_model_dir, how):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    if how == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    else:  # an interrupted copy: half the weights file
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


@pytest.mark.parametrize("how,needle", [
    pytest.param("no_tokenizer", "has none of the tokenizer files", marks=pytest.mark.slow),
    ("truncated", "cannot read the weights {folder}/model.safetensors"),
])
def test_broken_model_folder_is_named_with_what_to_do(tmp_path, tiny_model_dir, how, needle):
    folder = _broken_model(tmp_path, tiny_model_dir, how)
    r = _run(tmp_path / "run", tiny_model_dir, f"model.name={folder}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle.format(folder=folder) in r.stderr and str(folder) in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_eval_checks_its_output_paths_before_evaluating(tmp_path, tiny_model_dir, capsys):
    from mugrpo.cli import main

    taken = tmp_path / "results"
    taken.mkdir()
    args = ["eval", "--model", tiny_model_dir, "--task", "rg:basic_arithmetic", "--num-items", "1", "--k", "0"]
    assert main([*args, "--out", str(taken)]) == 2
    assert f"--out {taken}: is a folder" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main([*args, "--samples", str(blocker / "samples.jsonl")]) == 2
    assert "--samples" in capsys.readouterr().err
    assert list(taken.iterdir()) == [] and blocker.read_text() == "x"


def test_eval_of_a_run_dir_without_its_config_says_how_to_restore_it(tmp_path, capsys):
    from mugrpo.cli import main

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "ckpt_000002_s001_u00000").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    assert main(["eval", "--model", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "run directory without its config.yaml" in err and "checkpoints/ckpt_" in err


@pytest.mark.parametrize("content", [b"", b"not json\n\x00\x01 garbage\n", b"\xff\xfe\n", b"[1, 2]\n"])
def test_report_on_an_unusable_metrics_file_names_it(tmp_path, capsys, content):
    from mugrpo.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(content)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "report")]) == 2
    assert str(run_dir / "metrics.jsonl") in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_report_out_that_is_a_file_is_refused_before_drawing(tmp_path, capsys):
    from mugrpo.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"kind": "stage", "stage": 0, "update": 2, "update_in_stage": 2, '
                                           '"time_s": 1.0, "reward/mean": 0.5}\n')
    out = tmp_path / "report.md"
    out.write_text("mine")
    assert main(["report", str(run_dir), "--out", str(out)]) == 2
    assert f"--out {out}: is a file" in capsys.readouterr().err and out.read_text() == "mine"


def test_a_reward_that_segfaults_leaves_a_python_traceback(tmp_path, tiny_model_dir):
    r = _run(tmp_path / "run", tiny_model_dir, "task.reward_fn=toy_rewards:segfaults")
    assert r.returncode == -11  # SIGSEGV: nothing can be caught, but faulthandler prints where
    assert "Fatal Python error: Segmentation fault" in r.stderr and "toy_rewards.py" in r.stderr


def test_a_reward_that_calls_os_exit_is_an_error_not_a_silent_end(tmp_path, tiny_model_dir):
    # os._exit skips every handler; while a reward runs mugrpo turns it into an error of that call.
    r = _run(tmp_path / "run", tiny_model_dir, "task.reward_fn=toy_rewards:hard_exits")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [s["reward/num_errors"] for s in _records(tmp_path / "run", "stage")] == [128, 128]
    assert "called os._exit(3)" in r.stdout and "all 128 rewards failed" in r.stdout
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()


def test_prompt_plus_response_beyond_the_context_stops_at_start(tmp_path, tiny_model_dir):
    # The tiny model's context is 1024 positions: 1020 prompt + 8 response tokens = 1028 > 1024.
    r = _run(tmp_path / "run", tiny_model_dir, "task.max_prompt_tokens=1020")
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("task.max_prompt_tokens=1020 + rollout.max_new_tokens=8 = 1028 tokens exceed the context" in r.stderr
            and "(max_position_embeddings=1024); lower task.max_prompt_tokens to at most 1016" in r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, tiny_model_dir):
    import json

    from mugrpo.models.loading import ModelError, load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    tokens = config["vocab_size"]
    config["vocab_size"] = tokens - 3  # three token ids without an embedding row
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"has {tokens} tokens but the model's vocab_size is {tokens - 3}"):
        load_tokenizer(str(model))
    load_tokenizer(tiny_model_dir)  # the matching pair loads


def test_run_dir_that_is_a_file_is_named_as_such(tmp_path, capsys):
    from mugrpo.cli import main

    file = tmp_path / "notes.txt"
    file.write_text("mine")
    assert main(["train", "--run-dir", str(file)]) == 2
    assert f"--run-dir {file}: that is a file, not a run directory" in capsys.readouterr().err
    assert main(["train", "--resume", str(file)]) == 2
    assert f"--resume {file}: that is a file" in capsys.readouterr().err
    assert file.read_text() == "mine"


def test_a_full_disk_while_checkpointing_says_so_and_the_run_resumes(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import errno

    from mugrpo.cli import main
    from mugrpo.kit import checkpoint

    real, calls = checkpoint.save_file, []

    def full_on_second_checkpoint(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            real(tensors, path, *args, **kwargs)  # a partial file, as a real full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", full_on_second_checkpoint)
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), f"model.name={tiny_model_dir}", *TINY_OVERRIDES, "schedule.total_updates=4",
            "schedule.num_stages=2", "train.threads=1", "eval.num_items=0"]
    monkeypatch.syspath_prepend(str(TESTS))
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "no space left on device while writing a checkpoint" in err and "Traceback" not in err
    assert "the last complete one, ckpt_000002_s001_u00000, is intact" in err, err[-1500:]
    assert f"mugrpo train --resume {run_dir}" in err
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["ckpt_000002_s001_u00000"]  # no .tmp-*
    monkeypatch.setattr(checkpoint, "save_file", real)
    assert main(["train", "--resume", str(run_dir)]) == 0  # the advice works
    assert len(_records(run_dir, "update")) == 4
