"""Task specs for evaluation, on small local files laid out like the public benchmarks (no network)."""

import json

import pytest

from mugrpo.evaluation.sets import _parse_hf, detect_columns, resolve, split_specs
from mugrpo.config import TaskConfig
from mugrpo.rollout.tasks import TaskError

pytestmark = pytest.mark.unit


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def math500_file(tmp_path):
    # HuggingFaceH4/MATH-500 columns: problem, solution, answer, subject, level, unique_id
    rows = [{"problem": f"What is {i} + 1?", "solution": f"{i} + 1 = \\boxed{{{i + 1}}}", "answer": str(i + 1),
             "subject": "Prealgebra", "level": 1, "unique_id": f"test/{i}.json"} for i in range(5)]
    rows.append({"problem": "Simplify 28/6.", "solution": "...", "answer": "\\frac{14}{3}", "subject": "Algebra",
                 "level": 2, "unique_id": "test/frac.json"})
    return _jsonl(tmp_path / "math500.jsonl", rows)


def test_named_benchmark_from_a_local_copy_scores_with_math_verify(math500_file):
    es = resolve(f"math500={math500_file}", TaskConfig())
    assert es.name == "math500" and len(es.items) == 6  # every row: a benchmark has no train split
    assert es.items[0].question == "What is 0 + 1?" and es.items[0].answer == "1"
    texts = ["so \\boxed{1}", "\\boxed{3}", "no box: 3", "\\boxed{4.0}", "\\boxed{5}", "\\boxed{14/3}"]
    scores, stats = es.task.score_all(texts, es.items)
    # right, wrong (2), unboxed, 4.0 == 4, right, 14/3 == \frac{14}{3}
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert stats.num_unparsable == 1


def test_columns_are_detected_for_other_layouts(tmp_path):
    # Maxwell-Jia/AIME_2024: ID, Problem, Solution, Answer (an integer)
    aime = _jsonl(tmp_path / "aime.jsonl", [{"ID": "2024-I-1", "Problem": "Find 2 * 3.", "Solution": "...",
                                             "Answer": 6}])
    es = resolve(aime, TaskConfig())
    assert es.task_cfg.question_key == "Problem" and es.task_cfg.answer_key == "Answer"
    assert es.task.score_all(["\\boxed{6}"], es.items)[0].tolist() == [1.0]
    # zwhe99/amc23: id, question, answer (a float such as 142.0)
    amc = _jsonl(tmp_path / "amc.jsonl", [{"id": 0, "question": "Compute 100 + 42.", "answer": 142.0}])
    es = resolve(f"amc23={amc}", TaskConfig())
    assert es.items[0].answer == "142.0"
    assert es.task.score_all(["\\boxed{142}", "\\boxed{141}"], es.items * 2)[0].tolist() == [1.0, 0.0]


def test_prompt_format_and_scorer_come_from_the_base_config(math500_file):
    base = TaskConfig(instruction="Box it.", few_shot=[], reward_fn="ones_reward:reward")
    es = resolve(math500_file, base)
    assert es.task_cfg.instruction == "Box it." and es.task_cfg.few_shot == []
    assert es.task.score_all(["1111", "1x"], es.items[:2])[0].tolist() == [1.0, 0.5]  # the custom reward


def test_reasoning_gym_specs_and_num_items():
    es = resolve("rg:basic_arithmetic", TaskConfig(), num_items=5)
    assert len(es.items) == 5
    assert es.task_cfg.params == TaskConfig().params  # same generator as the base: its difficulty kept
    other = resolve("rg:chain_sum", TaskConfig(), num_items=3)
    assert other.task_cfg.params == {} and len(other.items) == 3
    right = [f"\\boxed{{{item.answer}}}" for item in es.items]
    assert es.task.score_all(right, es.items)[0].tolist() == [1.0] * 5


def test_train_spec_is_the_held_out_split():
    base = TaskConfig(eval_size=7)
    es = resolve("train", base)
    assert len(es.items) == 7
    assert es.items[0].entry["_split"] == "eval"  # generated with seed + 1, not training items
    assert len(resolve("train", base, num_items=2).items) == 2


def test_bad_specs_name_the_problem(tmp_path):
    with pytest.raises(TaskError, match="not understood.*math500"):
        resolve("gsm9k", TaskConfig())
    with pytest.raises(TaskError, match="does not exist"):
        resolve(str(tmp_path / "missing.jsonl"), TaskConfig())
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "hi", "label": "1"}])
    with pytest.raises(TaskError, match="no question column.*label.*text"):
        resolve(bad, TaskConfig())
    with pytest.raises(TaskError, match="empty source"):
        resolve("x=", TaskConfig())


def test_hf_spec_parsing_and_helpers():
    assert _parse_hf("opencompass/AIME2025@AIME2025-I:test", "s") == ("opencompass/AIME2025", "AIME2025-I", "test")
    assert _parse_hf("HuggingFaceH4/aime_2024:train", "s") == ("HuggingFaceH4/aime_2024", None, "train")
    assert _parse_hf("zwhe99/amc23", "s") == ("zwhe99/amc23", None, "test")
    assert split_specs(["math500,aime24", " rg:chain_sum "]) == ["math500", "aime24", "rg:chain_sum"]
    assert detect_columns(["question", "Answer"], ("question", "answer")) == ("question", "Answer")
    assert detect_columns(["q", "a", "problem", "answer"], ("q", "a")) == ("q", "a")  # configured keys win


def test_evaluation_of_a_run_with_several_rewards_scores_correctness_alone():
    from mugrpo.config import TaskConfig
    from mugrpo.evaluation.sets import resolve

    base = TaskConfig(size=4, eval_size=2, rewards=[{"fn": "correctness"}, {"fn": "python:somewhere.gone", "weight": 5}])
    es = resolve("train", base)
    right = f"\\\\boxed{{{es.items[0].answer}}}"
    assert es.task.score_all([right, "x"], es.items[:1] * 2)[0].tolist() == [1.0, 0.0]
