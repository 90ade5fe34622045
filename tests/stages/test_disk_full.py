"""A full disk while a replay copies a source stage, or while the final model is exported: one clear
message (what to free, and that ``--resume`` continues), the partial folder removed, and the advised
resume ends where the uninterrupted run ends (a stage's own writes and checkpoints:
tests/stages/test_store_writes.py, tests/rollout/test_rewards_faults.py)."""
import errno
import shutil

import pytest
from conftest import TESTS, TINY_OVERRIDES
from stages.test_replay_e2e import ONE_STAGE, _params, _updates

from mugrpo.cli import main
from mugrpo.observability.loggers import read_metrics

ARGS = [*TINY_OVERRIDES, *ONE_STAGE, "eval.num_items=0"]


@pytest.fixture(autouse=True)
def importable_rewards(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def _train(run_dir, model_dir, *extra):
    return main(["train", "--run-dir", str(run_dir), f"model.name={model_dir}", *ARGS, *extra])


def test_a_full_disk_while_exporting_the_final_model_says_so_and_the_resume_exports_it(tmp_path, tiny_model_dir,
                                                                                        monkeypatch, capsys):
    import transformers.modeling_utils as modeling

    assert _train(tmp_path / "ref", tiny_model_dir) == 0
    real = modeling.safe_save_file

    def full(tensors, path, *args, **kwargs):
        real(tensors, path, *args, **kwargs)  # a partial folder, as a real full disk leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(modeling, "safe_save_file", full)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert _train(run_dir, tiny_model_dir) == 2
    err = capsys.readouterr().err
    assert "no space left on device while writing the final model to" in err and "Traceback" not in err, err[-2000:]
    assert "Free at least " in err and "B (the model's weights)" in err
    assert f"mugrpo train --resume {run_dir}" in err
    assert not (run_dir / "final_model").exists() and not (run_dir / ".tmp-final_model").exists()
    assert any((run_dir / "checkpoints").glob("ckpt_*"))  # kept: what the message advises must work
    monkeypatch.setattr(modeling, "safe_save_file", real)
    assert main(["train", "--resume", str(run_dir)]) == 0
    ref, got = _params(tmp_path / "ref"), _params(run_dir)
    assert ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
    assert [r["update"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"] == [1, 2, 3, 4]


def test_a_full_disk_while_a_replay_copies_a_stage_says_so_and_the_resume_copies_it_again(tmp_path, tiny_model_dir,
                                                                                          monkeypatch, capsys):
    source, run_dir = tmp_path / "source", tmp_path / "replay"
    assert _train(source, tiny_model_dir) == 0
    real, calls = shutil.copyfile, []

    def full_on_second_copy(src, dst, *args, **kwargs):
        if str(run_dir) in str(dst):
            calls.append(dst)
            if len(calls) == 2:  # the shard is copied; the readable text fills the disk
                with open(dst, "w") as fh:
                    fh.write("partial")
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", full_on_second_copy)
    capsys.readouterr()
    assert _train(run_dir, tiny_model_dir, "--replay", str(source)) == 2
    err = capsys.readouterr().err
    assert "no space left on device while copying stage 0 of the replay source into" in err, err[-2000:]
    assert "Traceback" not in err and "the source is untouched" in err and "Free at least " in err
    assert f"mugrpo train --resume {run_dir}" in err
    assert not (run_dir / "stages" / "stage_000").exists()  # the partial copy (a shard, no marker) is gone
    assert (source / "stages" / "stage_000" / "shards.json").is_file()
    monkeypatch.setattr(shutil, "copyfile", real)
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert _updates(run_dir) == _updates(source)  # the same stage data, the same updates
