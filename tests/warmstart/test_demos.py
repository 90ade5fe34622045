"""Demonstrations without a teacher (mugrpo.warmstart.demos): solved calculator traces, and a run's
high-reward trajectories selected from its stored stages."""

import json
import re

import pytest
import torch

from mugrpo.rollout.envs.builtin import calculate
from mugrpo.run_dir import SHARDS_FILE, RunDir, shard_path
from mugrpo.stages.data import StageData
from mugrpo.warmstart.data import load_demonstrations
from mugrpo.warmstart.demos import calculator_rows, select_from_run, solved_trace, write_jsonl


def test_a_solved_trace_holds_the_real_tool_replies():
    prompt = [{"role": "user", "content": "6 * 7 + 8?"}]
    row = solved_trace(prompt, [("calculate", {"expression": "6 * 7"}), ("calculate", {"expression": "42 + 8"})],
                       "\\boxed{50}", [calculate])
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    # 6 * 7 = 42, then 42 + 8 = 50: each reply is the calculator's, named as the rollout loop names it
    assert [m["content"] for m in row["messages"] if m["role"] == "tool"] == ["42", "50"]
    assert row["messages"][2]["name"] == "calculate"
    assert row["messages"][3]["tool_calls"][0]["function"] == {"name": "calculate",
                                                                "arguments": {"expression": "42 + 8"}}
    assert row["tools"][0]["function"]["name"] == "calculate"
    with pytest.raises(ValueError, match="failed"):  # 1 / 0: a trace with a failed call is not solved
        solved_trace(prompt, [("calculate", {"expression": "1 / 0"})], "x", [calculate])


def test_two_call_calculator_traces_chain_the_first_reply_into_the_second_call():
    rows = calculator_rows(3, seed=7, num_calls=2)
    for row in rows:
        a, b, c, d = map(int, re.findall(r"\d+", row["question"]))
        assert row["question"] == f"What is {a} * {b} + {c} * {d}?"
        user, call1, reply1, call2, reply2, final = row["messages"]
        assert user["content"].startswith(row["question"] + "\n\nUse the calculate tool")
        assert call1["tool_calls"][0]["function"]["arguments"] == {"expression": f"{a} * {b}"}
        assert reply1["content"] == str(a * b)  # Python's integers, not the calculator
        assert call2["tool_calls"][0]["function"]["arguments"] == {"expression": f"{a * b} + {c} * {d}"}
        assert reply2["content"] == row["answer"] == str(a * b + c * d)
        assert final["content"] == f"The answer is \\boxed{{{a * b + c * d}}}."
    assert len({r["question"] for r in rows}) == 3  # different questions
    (one,) = calculator_rows(1, seed=7, num_calls=1)
    a, b, c = map(int, re.findall(r"\d+", one["question"]))
    assert [m["role"] for m in one["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert one["answer"] == str(a * b + c)
    with pytest.raises(ValueError, match="num_calls"):
        calculator_rows(1, num_calls=3)


def test_written_traces_load_as_demonstrations(tmp_path):
    path = write_jsonl(calculator_rows(2, seed=1, num_calls=2), tmp_path / "demos" / "calc.jsonl")
    assert len(path.read_text().splitlines()) == 2
    demos = load_demonstrations(path)
    assert [[t.calls_tool for t in d.turns] for d in demos] == [[True, True, False]] * 2
    assert all(d.tools[0]["function"]["name"] == "calculate" for d in demos)  # the schemas column


def write_stage(run_dir, stage, data, complete=True):
    folder = RunDir(run_dir).stage(stage)
    data.save(shard_path(folder, 0))
    if complete:
        (folder / SHARDS_FILE).write_text(json.dumps({"num_shards": 1, "num_groups": [data.num_groups]}))


def stage(prompts, responses, rewards, finished, turns=None):
    G = len(responses) // len(prompts)
    return StageData(prompts, responses, [[0.0] * len(r) for r in responses], torch.tensor(rewards),
                     torch.zeros(len(responses)), torch.tensor(finished), list(range(len(prompts))), G, turns=turns)


def test_rejection_sampling_keeps_rewarded_finished_trajectories_with_their_policy_mask(tmp_path):
    # Stage 0 (multi-turn, G = 2): rewards 1, 0, 0.5, 1; the last one cut at the budget (unfinished).
    write_stage(tmp_path, 0, stage([[1, 2], [3]], [[10, 11, 2], [12, 2], [13, 9, 9, 14, 2], [15, 15]],
                                   [1.0, 0.0, 0.5, 1.0], [True, True, True, False],
                                   turns=[[0, 0, 0], [0, 0], [0, -1, -1, 1, 1], [0, 0]]))
    # Stage 1 (single-turn, G = 1): reward 1. Stage 2 has no shards.json: still being written, skipped.
    write_stage(tmp_path, 1, stage([[5]], [[20, 2]], [1.0], [True]))
    write_stage(tmp_path, 2, stage([[6]], [[21, 2]], [1.0], [True]), complete=False)
    examples, counts = select_from_run(tmp_path, min_reward=0.5)
    # read 4 + 1 = 5; kept: stage 0's sequences 0 (1.0) and 2 (0.5 >= 0.5), stage 1's sequence 0;
    # sequence 3 of stage 0 is rewarded but unfinished
    assert counts == {"num_total": 5, "num_kept": 3, "num_unfinished": 1, "num_stages": 2, "reward_max": 1.0}
    assert [e.source for e in examples] == [(0, 0, 0), (0, 0, 2), (1, 0, 0)]
    first, multi, single = examples
    assert (first.prompt_ids, first.response_ids, first.response_mask) == ([1, 2], [10, 11, 2], [1, 1, 1])
    # sequence 2 belongs to group 2 // 2 = 1, prompt [3]; its environment tokens (turn -1) are not trained
    assert (multi.prompt_ids, multi.turns, multi.response_mask) == ([3], [0, -1, -1, 1, 1], [1, 0, 0, 1, 1])
    assert (single.input_ids, single.loss_mask, single.turns) == ([5, 20, 2], [0, 1, 1], [0, 0])
    _, counts = select_from_run(tmp_path, min_reward=0.5, finished_only=False)
    assert (counts["num_kept"], counts["num_unfinished"]) == (4, 0)
    _, counts = select_from_run(tmp_path, min_reward=2.0)
    assert (counts["num_kept"], counts["num_total"]) == (0, 5)
