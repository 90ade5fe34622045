"""what a stage's writes and a mid-stage resume keep.

- a full disk while a stage's data is written: one clear message (like a checkpoint's), nothing
  lost, and the advised ``--resume`` ends where the uninterrupted run ends;
- a resume past a stage's first update still logs that stage's ``stage/engine_logprob_mismatch``
  (it was null: only the first update set it, and a resumed run never ran that update again).
"""
import errno
import subprocess
import sys

import pytest
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file
from kit.test_resume import _cmd, _env

from mugrpo.observability.loggers import read_metrics

ARGS = [*TINY_OVERRIDES, "schedule.total_updates=4", "schedule.num_stages=2", "train.threads=1",
        "train.deterministic=true", "eval.num_items=0"]


def _params(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.mark.parametrize("full_at, start", [(1, "the initial weights (no checkpoint yet)"),
                                            (2, "the last checkpoint, ckpt_000002_s001_u00000")])
def test_a_full_disk_while_writing_a_stage_says_so_and_the_run_resumes(tmp_path, tiny_model_dir, monkeypatch,
                                                                       capsys, full_at, start):
    from mugrpo.cli import main
    from mugrpo.stages import data

    monkeypatch.syspath_prepend(str(TESTS))
    ref_dir = tmp_path / "ref"
    assert main(["train", "--run-dir", str(ref_dir), f"model.name={tiny_model_dir}", *ARGS]) == 0
    real, calls = data.save_file, []

    def full_on_nth_shard(tensors, path, *args, **kwargs):
        calls.append(path)
        real(tensors, path, *args, **kwargs)  # a partial file, as a real full disk leaves
        if len(calls) == full_at:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data, "save_file", full_on_nth_shard)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run_dir), f"model.name={tiny_model_dir}", *ARGS]) == 2
    err = capsys.readouterr().err
    assert "no space left on device while writing the stage data in" in err and "Traceback" not in err, err[-2000:]
    assert f"stage_00{full_at - 1}" in err and f"a resume generates it again from {start}" in err
    assert f"mugrpo train --resume {run_dir}" in err
    # Kept, even when stage 0 failed: what the message advises must work.
    assert not (run_dir / "stages" / f"stage_00{full_at - 1}" / "shards.json").exists()
    monkeypatch.setattr(data, "save_file", real)
    assert main(["train", "--resume", str(run_dir)]) == 0
    ref, got = _params(ref_dir), _params(run_dir)
    assert all(ref[k].equal(got[k]) for k in ref)
    assert [r["update"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"] == [1, 2, 3, 4]


@pytest.mark.slow  # ~25 s; one metric after a mid-stage resume
def test_a_mid_stage_resume_still_logs_the_stage_engine_logprob_mismatch(tmp_path, tiny_model_dir):
    # Killed after update 3 of stage 0 (checkpoint at update 2): the resumed stage starts at its third update.
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.run(_cmd(ref_dir, tiny_model_dir), env=_env(), capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env("update:3"), capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    key = "stage/engine_logprob_mismatch"
    want = [r[key] for r in read_metrics(ref_dir / "metrics.jsonl") if r["kind"] == "stage"]
    got = [r[key] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"]
    assert None not in want and got == want
