"""rollouts.jsonl a person can read: the prompt, the turns with their roles, how the
trajectory ended, its reward and advantage; the keys readers use stay."""
import json
from types import SimpleNamespace

import torch

from mugrpo.stages.data import ENV_TURN, StageData, write_stage_text

SPECIAL = {0: "<eos>"}


class LetterTokenizer:
    """Token id i decodes to the i-th letter; id 0 is a special token."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(SPECIAL[i] if i in SPECIAL else chr(ord("a") + i - 1)
                       for i in ids if not (skip_special_tokens and i in SPECIAL))


def _lines(tmp_path, data):
    items = [SimpleNamespace(answer="7"), SimpleNamespace(answer="9")]
    write_stage_text(tmp_path / "rollouts.jsonl", data, LetterTokenizer(), items)
    return [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]


def test_a_multi_turn_trajectory_reads_turn_by_turn(tmp_path):
    # One group of 2: trajectory 0 = policy "ab", environment "<eos>c", policy "d";
    # trajectory 1 = policy "e" only, cut at the budget.
    data = StageData([[8, 9]], [[1, 2, 0, 3, 4], [5]], [[-0.1] * 5, [-0.2]], torch.tensor([1.0, 0.0]),
                     torch.tensor([0.7071, -0.7071]), torch.tensor([True, False]), [1], 2,
                     turns=[[0, 0, ENV_TURN, ENV_TURN, 1], [0]])
    first, second = _lines(tmp_path, data)
    assert first["prompt"] == "hi" and first["answer"] == "9"
    assert first["turns"] == [{"role": "policy", "turn": 0, "text": "ab"},
                              {"role": "environment", "text": "<eos>c"},
                              {"role": "policy", "turn": 1, "text": "d"}]
    assert (first["reward"], first["advantage"], first["end"]) == (1.0, 0.7071, "finished")
    assert second["turns"] == [{"role": "policy", "turn": 0, "text": "e"}]
    assert (second["reward"], second["advantage"], second["end"]) == (0.0, -0.7071, "truncated")
    # The keys read before (tests, benchmarks/smollm/long_cot.py) are still there.
    assert (first["response"], first["finished"], first["num_tokens"]) == ("abcd", True, 5)
    assert (first["num_policy_tokens"], first["num_turns"], first["group"], first["item"]) == (3, 2, 0, 1)


def test_a_single_turn_response_is_one_policy_turn(tmp_path):
    data = StageData([[1]], [[2, 3], []], [[-0.1, -0.1], []], torch.tensor([0.5, 0.5]), torch.zeros(2),
                     torch.tensor([True, True]), [0], 2)
    first, empty = _lines(tmp_path, data)
    assert first["prompt"] == "a" and first["turns"] == [{"role": "policy", "turn": 0, "text": "bc"}]
    assert empty["turns"] == [] and empty["end"] == "finished"
    assert "num_turns" not in first
