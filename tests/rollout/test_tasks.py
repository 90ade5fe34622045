import json
import math

import pytest

from mugrpo.config import TaskConfig
from mugrpo.rollout.tasks import Item, TaskError, build_task, extract_boxed, prompt_ids, render_messages

pytestmark = pytest.mark.unit


def test_extract_boxed():
    assert extract_boxed("so 3 + 4 = 7. The final answer is \\boxed{7}.") == "7"
    assert extract_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # last, nested braces
    assert extract_boxed("no answer here") is None
    assert extract_boxed("\\boxed{5} and an unclosed \\boxed{6") == "5"


def test_reasoning_gym_task_scores_with_its_own_checker():
    task = build_task(TaskConfig(size=20, eval_size=5))
    item = task.items[0]
    rewards, stats = task.score_all(
        [f"It is \\boxed{{{item.answer}}}", f"\\boxed{{{int(item.answer) + 1}}}", item.answer], [item] * 3)
    assert rewards.tolist() == [1.0, 0.0, 0.0]  # correct, wrong, unboxed
    assert stats.num_unparsable == 1 and stats.num_errors == 0
    assert len(task.eval_items) == 5
    assert "+" in item.question or "-" in item.question


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_math_task_from_local_file_with_column_mapping(tmp_path):
    rows = [{"problem": f"Expand {i}", "solution": "(x+1)^2"} for i in range(6)] + [{"problem": "bad", "solution": None}]
    cfg = TaskConfig(kind="math", name=_write_jsonl(tmp_path / "d.jsonl", rows), question_key="problem",
                     answer_key="solution", eval_size=2)
    task = build_task(cfg)
    assert len(task.items) == 4 and len(task.eval_items) == 2  # the malformed row is skipped
    item = task.items[0]
    rewards, _ = task.score_all(["\\boxed{(x+1)^2}", "\\boxed{x^2+2x+1}", "\\boxed{x^2}", "(x+1)^2"], [item] * 4)
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # math-verify: equivalent forms match; unboxed scores 0


@pytest.mark.parametrize("rows,kw,needle", [
    ([{"q": "a", "answer": "1"}], {}, "no column 'question'"),
    ([], {}, "empty"),
])
def test_math_task_errors(tmp_path, rows, kw, needle):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TaskError, match=needle):
        build_task(TaskConfig(kind="math", name=str(path), **kw))


def test_missing_dataset_file_and_unknown_generator():
    with pytest.raises(TaskError, match="does not exist"):
        build_task(TaskConfig(kind="math", name="/nonexistent/data.jsonl"))
    with pytest.raises(TaskError, match="no_such_task"):
        build_task(TaskConfig(name="no_such_task"))


@pytest.mark.parametrize("fn,counter", [
    ("raises", "num_errors"), ("exits", "num_errors"), ("returns_none", "num_invalid"),
    ("returns_nan", "num_invalid"), ("huge", "num_invalid"), ("returns_text", "num_invalid"),
    ("hangs", "num_timeouts"),
])
def test_faulty_reward_functions_score_zero_and_are_counted(fn, counter):
    task = build_task(TaskConfig(size=4, eval_size=1, reward_fn=f"toy_rewards:{fn}", reward_timeout_s=0.3))
    rewards, stats = task.score_all(["\\boxed{1}", "x"], task.items[:2])
    assert rewards.tolist() == [0.0, 0.0]
    assert getattr(stats, counter) == 2
    if fn == "raises":
        assert "RuntimeError: boom" in stats.first_error
    if fn == "exits":  # sys.exit() inside a reward is an error of that call, not the end of the run
        assert "SystemExit" in stats.first_error


def test_ctrl_c_inside_a_reward_function_still_stops():
    task = build_task(TaskConfig(size=4, eval_size=1, reward_fn="toy_rewards:interrupted"))
    with pytest.raises(KeyboardInterrupt):
        task.score_all(["x"], task.items[:1])


def test_custom_reward_function_gets_completion_answer_and_row():
    task = build_task(TaskConfig(size=4, eval_size=1, reward_fn="toy_rewards:frac_ones"))
    rewards, _ = task.score_all(["1111", "1x1x"], task.items[:2])
    assert rewards.tolist() == [1.0, 0.5]


def test_bad_reward_fn_spec():
    with pytest.raises(TaskError, match="cannot import module"):
        build_task(TaskConfig(size=4, reward_fn="no_such_module:f"))
    with pytest.raises(TaskError, match="no function 'nope'"):
        build_task(TaskConfig(size=4, reward_fn="toy_rewards:nope"))


def test_prompt_rendering_with_one_shot_and_instruction(tiny_model_dir):
    from mugrpo.models.loading import load_tokenizer

    cfg = TaskConfig()
    messages = render_messages("What is 2 + 2?", cfg)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[-1]["content"] == "What is 2 + 2?\n\nPut your final answer within \\boxed{}."
    tok = load_tokenizer(tiny_model_dir)
    text = tok.decode(prompt_ids(tok, "What is 2 + 2?", cfg))
    assert text.startswith("u:What is 3 + 4?") and text.endswith("a:")
    assert "The final answer is \\boxed{7}." in text


def test_task_sampling_is_seeded_and_covers_the_pool():
    import torch

    task = build_task(TaskConfig(size=10, eval_size=1))
    a = task.sample(25, torch.Generator().manual_seed(3))
    b = task.sample(25, torch.Generator().manual_seed(3))
    n = len(task.items)  # 10, less any item whose question is held out
    assert n >= 8 and a == b and sorted(a[:n]) == list(range(n))  # the first n draws are a permutation


@pytest.mark.parametrize("source,needle", [
    ("import no_such_dependency_xyz\n", "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
    ("raise RuntimeError('no API key')\n", "RuntimeError: no API key"),
    ("def f(c, a, i:\n    return 0\n", "SyntaxError"),
])
def test_reward_module_that_fails_inside_its_import_reports_the_real_cause(tmp_path, monkeypatch, source, needle):
    (tmp_path / "broken_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError) as info:
        build_task(TaskConfig(size=4, reward_fn="broken_reward:f"))
    message = str(info.value)
    assert needle in message and f"{tmp_path / 'broken_reward.py'}:" in message
    assert "PYTHONPATH" not in message  # the module was found; its own import failed


def test_malformed_jsonl_row_names_file_line_and_cause(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": 4\n')
    with pytest.raises(TaskError, match=r"d\.jsonl', line 2: not valid JSON \(Expecting ',' delimiter at column 32\)"):
        build_task(TaskConfig(kind="math", name=str(path)))


def test_upper_case_jsonl_suffix_is_a_jsonl_file(tmp_path):
    rows = [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(4)]
    task = build_task(TaskConfig(kind="math", name=_write_jsonl(tmp_path / "D.JSONL", rows), eval_size=0))
    assert [item.answer for item in task.items] == ["1", "2", "3", "4"]


def _questions(items):
    return {" ".join(i.question.split()).casefold() for i in items}


def test_default_task_held_out_never_occurs_in_training(capsys):
    # The default task has 242 distinct questions and its seed+1 draw repeats training ones: the
    # held-out set takes questions out of training, up to a third of them (80), and says so.
    task = build_task(TaskConfig())
    train_q, held_q = _questions(task.items), _questions(task.eval_items)
    assert not train_q & held_q
    assert len(task.eval_items) == len(held_q) == 242 // 3
    assert len(train_q) == 242 - 242 // 3
    assert "80 held-out items instead of task.eval_size=200" in capsys.readouterr().out


def test_large_task_keeps_its_full_held_out_set():
    cfg = TaskConfig(params={"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 3}, size=2000, eval_size=50)
    task = build_task(cfg)
    assert len(task.eval_items) == 50 and not _questions(task.items) & _questions(task.eval_items)


def test_math_rows_repeated_across_the_split_leave_training(tmp_path):
    # Rows 0..9 are distinct; rows 10..11 repeat questions 0 and 1 (up to case and spaces), and
    # land in the held-out tail: questions 0 and 1 must leave training, the held-out set is deduplicated.
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]
    rows += [{"question": "what is 0  + 1?", "answer": "1"}, {"question": "What is 1 + 1?", "answer": "2"},
             {"question": "What is 1 + 1?", "answer": "2"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = build_task(TaskConfig(kind="math", name=str(path), eval_size=3, few_shot=[]))
    assert [i.question for i in task.eval_items] == ["what is 0  + 1?", "What is 1 + 1?"]
    assert [i.question for i in task.items] == [f"What is {i} + 1?" for i in range(2, 10)]


def test_truncation_keeps_the_tail_of_each_prompt():
    from mugrpo.rollout.tasks import limit_prompts

    # limit 3: [1..5] keeps its last three tokens (the question and the generation prompt sit at the end);
    # a prompt within the limit is unchanged.
    cfg = TaskConfig(max_prompt_tokens=3, prompt_too_long="truncate")
    prompts, kept = limit_prompts([[1, 2, 3, 4, 5], [7, 8]], cfg, "training")
    assert prompts == [[3, 4, 5], [7, 8]] and kept == [0, 1]


def test_an_integer_prompt_is_refused_naming_the_row():
    with pytest.raises(TaskError, match="row 1: the prompt column 'prompt' holds a int \\(7\\)"):
        build_task(TaskConfig(eval_size=0, reward_fn="toy_rewards:frac_ones"),
                   rows=[{"prompt": "a question"}, {"prompt": 7}])


def test_rows_without_an_answer_are_kept_unless_a_reward_checks_answers():
    rows = [{"prompt": "q1", "answer": "1"}, {"prompt": "q2", "answer": None}, {"prompt": "q3", "answer": ""}]
    own = build_task(TaskConfig(eval_size=0, reward_fn="toy_rewards:frac_ones"), rows=rows)
    assert [item.answer for item in own.items] == ["1", "", ""]
    checked = build_task(TaskConfig(eval_size=0), rows=rows)  # correctness (math-verify) needs the answer
    assert [item.answer for item in checked.items] == ["1"]
