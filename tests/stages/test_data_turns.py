"""Stage data with multi-turn ``turns``: persisted (format version 2), old files load as single-turn,
and both collate layouts mask environment tokens out of the loss while keeping them as inputs."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from mugrpo.kit import distributed as dist
from mugrpo.run_dir import SHARDS_FILE, shard_path
from mugrpo.stages import shards
from mugrpo.kit.batching import micro_batches
from mugrpo.stages.data import FORMAT_VERSION, StageData, StageDataError
from mugrpo.kit.batching import collate

pytestmark = pytest.mark.unit


def _stage(turns=True):
    # 1 group of G = 2. Sequence 0: 2 policy tokens, 2 env tokens, 1 policy token (turn 1);
    # sequence 1: 3 policy tokens of turn 0.
    return StageData([[5, 6]], [[10, 11, 40, 41, 12], [20, 21, 22]],
                     [[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.4, -0.5, -0.6]], torch.tensor([1.0, 0.0]),
                     torch.tensor([0.5, -0.5]), torch.tensor([True, False]), [7], 2,
                     turns=[[0, 0, -1, -1, 1], [0, 0, 0]] if turns else None)


def test_turns_round_trip_as_int8_with_the_format_version(tmp_path):
    _stage().save(tmp_path / "s.safetensors")
    raw = load_file(str(tmp_path / "s.safetensors"))
    assert raw["turns"].dtype == torch.int8 and raw["turns"].tolist() == [0, 0, -1, -1, 1, 0, 0, 0]
    back = StageData.load(tmp_path / "s.safetensors")
    assert back.turns == [[0, 0, -1, -1, 1], [0, 0, 0]]
    assert [back.num_policy_tokens(s) for s in range(2)] == [3, 3]  # 5 - 2 env tokens; 3
    assert FORMAT_VERSION == 2


def test_a_version_1_file_without_turns_loads_as_all_turn_0(tmp_path):
    # What a run directory written before this change holds: no turns, format_version "1" (or none).
    _stage(turns=False).save(tmp_path / "s.safetensors")
    tensors = load_file(str(tmp_path / "s.safetensors"))
    for meta in ({"group_size": "2", "format_version": "1"}, {"group_size": "2"}):
        save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
        old = StageData.load(tmp_path / "old.safetensors")
        assert old.turns is None and old.turns_of(0) == [0] * 5 and old.num_policy_tokens(0) == 5
        assert collate(old, [0, 1], pad_id=0).response_mask.sum() == 8  # every response token


def test_a_file_from_a_newer_format_is_refused(tmp_path):
    _stage().save(tmp_path / "s.safetensors")
    save_file(load_file(str(tmp_path / "s.safetensors")), str(tmp_path / "new.safetensors"),
              metadata={"group_size": "2", "format_version": str(FORMAT_VERSION + 1)})
    with pytest.raises(StageDataError, match="newer mugrpo"):
        StageData.load(tmp_path / "new.safetensors")


def test_both_layouts_keep_env_tokens_as_inputs_but_not_as_loss_tokens():
    data = _stage()
    mb = collate(data, [0, 1], pad_id=0)
    assert mb.input_ids[0, 2:].tolist() == [10, 11, 40, 41, 12]  # env ids are in the sequence
    assert mb.response_mask.tolist() == [[True, True, False, False, True], [True, True, True, False, False]]
    assert mb.turns.tolist() == [[0, 0, -1, -1, 1], [0, 0, 0, 0, 0]]
    (shared,) = micro_batches(data, [0, 1], shared=True, budget=100, max_seqs=None, pad_id=0)
    assert shared.input_ids[0].tolist() == [5, 6, 10, 11, 40, 41, 12, 20, 21, 22]
    assert torch.equal(shared.response_mask, mb.response_mask)
    sub = data.subset([0])
    assert sub.turns == data.turns


def test_sharded_stages_concatenate_turns(tmp_path):
    # Two shards, one multi-turn and one old-style (no turns): the rank owning both sees turns for all.
    _stage().save(shard_path(tmp_path, 0))
    _stage(turns=False).save(shard_path(tmp_path, 1))
    (tmp_path / SHARDS_FILE).write_text('{"num_shards": 2, "num_groups": [1, 1]}')
    data = shards.load_stage_shards(tmp_path, dist.World())
    assert data.turns == [[0, 0, -1, -1, 1], [0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0]]
