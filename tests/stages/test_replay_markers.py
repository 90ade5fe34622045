"""Stage files and replay sources: a marker that lists no shards is no stage, and
each shard's sha256 recorded in shards.json names a damaged or swapped shard on load and on copy;
stages written before checksums existed still load."""
import hashlib
import json

import pytest
from stages.test_replay import new_cfg, stage, write_run

from mugrpo.stages import replay
from mugrpo.run_dir import SHARDS_FILE, RunDir, shard_path
from mugrpo.stages.data import StageDataError
from mugrpo.kit.distributed import World
from mugrpo.stages.shards import load_stage_shards, save_stage_shard


def _flip_last_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # inside the last tensor's data: the file still parses
    path.write_bytes(bytes(raw))


def test_a_source_whose_marker_lists_no_shards_is_refused(tmp_path):
    write_run(tmp_path / "src")
    folder = RunDir(tmp_path / "src").stage(0)
    shard_path(folder, 0).unlink()
    (folder / SHARDS_FILE).write_text(json.dumps({"num_shards": 0, "num_groups": []}))
    assert replay.complete_stages(tmp_path / "src") == ()
    with pytest.raises(replay.ReplayError, match="holds no complete stage"):
        replay.check_source(tmp_path / "src", new_cfg())


def test_a_marker_emptied_after_the_check_is_not_copied_as_an_empty_stage(tmp_path):
    write_run(tmp_path / "src")
    src = replay.check_source(tmp_path / "src", new_cfg())
    marker = RunDir(tmp_path / "src").stage(0) / SHARDS_FILE
    marker.write_text(json.dumps({"num_shards": 0, "num_groups": []}))
    with pytest.raises(replay.ReplayError, match=f"{marker} lists no shards"):
        replay.copy_stage(src, 0, tmp_path / "dest", need_trainer_logprobs=False)
    assert not (tmp_path / "dest" / SHARDS_FILE).exists()


def test_a_written_stage_records_each_shards_sha256(tmp_path):
    save_stage_shard(stage(), tmp_path, World())
    meta = json.loads((tmp_path / SHARDS_FILE).read_text())
    assert meta["sha256"] == [hashlib.sha256(shard_path(tmp_path, 0).read_bytes()).hexdigest()]
    assert load_stage_shards(tmp_path, World()).num_groups == 2


def test_a_damaged_shard_that_still_parses_is_named_on_load(tmp_path):
    save_stage_shard(stage(), tmp_path, World())
    path = shard_path(tmp_path, 0)
    _flip_last_byte(path)
    with pytest.raises(StageDataError, match=f"{path} cannot be read \\(its sha256 is .* but {SHARDS_FILE} "
                                             "recorded .* for shard 0"):
        load_stage_shards(tmp_path, World())


def test_a_shard_swapped_in_from_another_stage_is_named_on_load(tmp_path):
    save_stage_shard(stage((0, 1)), tmp_path / "a", World())
    save_stage_shard(stage((1, 0)), tmp_path / "b", World())
    shard_path(tmp_path / "a", 0).write_bytes(shard_path(tmp_path / "b", 0).read_bytes())
    with pytest.raises(StageDataError, match="swapped with another shard"):
        load_stage_shards(tmp_path / "a", World())


def test_a_stage_written_before_checksums_still_loads(tmp_path):
    stage().save(shard_path(tmp_path, 0))
    (tmp_path / SHARDS_FILE).write_text(json.dumps({"num_shards": 1, "num_groups": [2]}))
    assert load_stage_shards(tmp_path, World()).item_indices == [0, 1]


def test_a_damaged_source_shard_is_named_on_copy(tmp_path):
    write_run(tmp_path / "src")
    folder = RunDir(tmp_path / "src").stage(0)
    marker = json.loads((folder / SHARDS_FILE).read_text())
    marker["sha256"] = [hashlib.sha256(shard_path(folder, 0).read_bytes()).hexdigest()]
    (folder / SHARDS_FILE).write_text(json.dumps(marker))
    src = replay.check_source(tmp_path / "src", new_cfg())
    assert replay.copy_stage(src, 0, tmp_path / "ok", need_trainer_logprobs=False) == 8  # intact: copied
    assert json.loads((tmp_path / "ok" / SHARDS_FILE).read_text())["sha256"] == marker["sha256"]
    _flip_last_byte(shard_path(folder, 0))
    with pytest.raises(replay.ReplayError, match=f"replay source file {shard_path(folder, 0)} cannot be read "
                                                 "\\(its sha256 is"):
        replay.copy_stage(src, 0, tmp_path / "dest", need_trainer_logprobs=False)
    assert not (tmp_path / "dest" / SHARDS_FILE).exists()
