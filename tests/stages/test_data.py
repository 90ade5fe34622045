"""The stage data's schema (mugrpo.stages.data.SCHEMA): every field survives a save and load, a subset and a
gather of groups from several parts, so adding a field to the schema is enough for all of them."""
import pytest
import torch

from mugrpo.stages.data import SCHEMA, StageData, gather_groups

pytestmark = pytest.mark.unit


def _data(offset: int, turns: bool = True, trainer: bool = True) -> StageData:
    # 2 groups of G = 2: sequence s has response [10 * (s + offset), ...] of length s + 1
    responses = [[10 * (s + offset) + t for t in range(s + 1)] for s in range(4)]
    return StageData([[1, offset], [2, offset]], responses, [[-0.5 * (t + 1) for t in range(len(r))] for r in responses],
                     torch.tensor([1.0, 0.0, 0.5, 0.25]) + offset, torch.tensor([0.5, -0.5, 0.1, -0.1]),
                     torch.tensor([True, False, True, True]), [7 + offset, 8 + offset], 2,
                     trainer_logprobs=[[-0.25] * len(r) for r in responses] if trainer else None,
                     turns=[[0] * len(r) for r in responses] if turns else None)


def _fields(data: StageData) -> dict:
    out = {}
    for f in SCHEMA:
        value = getattr(data, f.name)
        out[f.name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return out


def test_every_field_of_the_schema_survives_save_and_load(tmp_path):
    data = _data(0)
    data.save(tmp_path / "shard.safetensors")
    back = StageData.load(tmp_path / "shard.safetensors")
    assert _fields(back) == _fields(data) and back.group_size == 2
    assert back.finished.dtype == torch.bool and back.rewards.dtype == torch.float32


def test_the_schema_names_every_field_of_stage_data():
    import dataclasses

    assert [f.name for f in SCHEMA] == [f.name for f in dataclasses.fields(StageData) if f.name != "group_size"]


def test_a_subset_keeps_whole_groups_in_order():
    sub = _data(0).subset([1])
    assert sub.prompts == [[2, 0]] and sub.item_indices == [8]
    assert sub.responses == [[20, 21, 22], [30, 31, 32, 33]]  # sequences 2 and 3 (group 1 of G = 2)
    assert sub.rewards.tolist() == [0.5, 0.25] and sub.finished.tolist() == [True, True]
    assert sub.trainer_logprobs == [[-0.25] * 3, [-0.25] * 4] and sub.turns == [[0] * 3, [0] * 4]


def test_gathering_groups_of_several_parts_carries_every_field():
    a, b = _data(0), _data(100)
    out = gather_groups([(b, 0), (a, 1)], a)
    assert out.prompts == [[1, 100], [2, 0]] and out.item_indices == [107, 8]
    assert out.responses == [b.responses[0], b.responses[1], a.responses[2], a.responses[3]]
    assert out.rewards.tolist() == [101.0, 100.0, 0.5, 0.25]
    assert out.advantages.tolist() == pytest.approx([0.5, -0.5, 0.1, -0.1])


def test_an_optional_field_missing_from_a_part():
    with_turns, without = _data(0, turns=True, trainer=True), _data(1, turns=False, trainer=False)
    out = gather_groups([(with_turns, 0), (without, 0)], with_turns)
    assert out.turns == [[0], [0, 0], [0], [0, 0]]  # turns are filled (all policy turn 0) ...
    assert out.trainer_logprobs is None  # ... trainer log-probs cannot be: dropped unless every part has them


def test_an_empty_subset_keeps_the_types():
    sub = _data(0).subset([])
    assert sub.num_groups == 0 and sub.finished.dtype == torch.bool and sub.trainer_logprobs == []
