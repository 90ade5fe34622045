"""The long toy lab's task (benchmarks/toy_lab/long_task.py) and its trigger classifier (triggers.py)."""

import json

import pytest

from benchmarks.toy_lab import long_task
from benchmarks.toy_lab.triggers import decisive_positions

pytestmark = pytest.mark.bench  # a benchmark's bookkeeping: `pytest -m bench benchmarks/tests` runs it


def test_target_text_writes_every_running_total():
    # 7 + 3 = 10, 10 + 5 = 15
    assert long_task.target_text([7, 3, 5]) == "a=7, b=3: 7+3=10, c=5: 10+5=15, \\boxed{15}"
    assert long_task.target_text([7, 3], "verbose") == "a is 7. b is 3, so 7+3=10. \\boxed{10}"


def test_score_is_an_exact_match_of_the_last_box():
    assert long_task.score("a=7, b=3: 7+3=10, \\boxed{10}", "10", {}) == 1.0
    assert long_task.score("\\boxed{10} then \\boxed{11}", "10", {}) == 0.0  # the last box counts
    assert long_task.score("a=7, b=3: 7+3=10, ", "10", {}) == 0.0  # no box
    assert long_task.score("\\boxed{ 10 }", "10", {}) == 1.0  # extract_boxed strips spaces


def test_data_file_holds_out_unseen_questions_at_the_end(tmp_path):
    spec = long_task.LongSpec(train_size=300, eval_size=40, min_terms=3, max_terms=4)
    rows = [json.loads(line) for line in long_task.data_file(spec, cache=tmp_path).read_text().splitlines()]
    assert len(rows) == 340
    train, held_out = rows[:300], rows[300:]
    assert not {r["question"] for r in held_out} & {r["question"] for r in train}
    for r in rows:
        assert sum(r["terms"]) == int(r["answer"])
        assert 3 <= len(r["terms"]) <= 4
        assert r["question"].startswith(f"a{r['terms'][0]} b{r['terms'][1]}")


def test_task_overrides_plug_the_task_into_mugrpo(tmp_path):
    from mugrpo.config import load_config
    from mugrpo.rollout.tasks import build_task

    spec = long_task.LongSpec(train_size=100, eval_size=20)
    task = build_task(load_config("grpo", overrides=long_task.task_overrides(spec, tmp_path)).task)
    assert (len(task.items), len(task.eval_items)) == (100, 20)
    item = task.eval_items[0]
    rewards, _ = task.score_all([long_task.target_text(item.entry["terms"]), "\\boxed{0}"], [item, item])
    assert rewards.tolist() == [1.0, 0.0]


def test_decisive_positions_are_the_computed_digits():
    text = "a=7, b=3: 7+3=10, \\boxed{10}"
    # "10" after "7+3=" sits at 14-15, the boxed "10" at 25-26; "a=7" and "b=3" are looked-up terms
    assert decisive_positions(text) == {14, 15, 25, 26}
