"""The Python API (mugrpo.train): config in code, callables as rewards, rows as data, several weighted
rewards, TRL-style conversion, resume after SIGKILL, and clear errors for bad input."""
import os
import subprocess
import sys

import pytest
import yaml
from conftest import TESTS
from safetensors.torch import load_file

import mugrpo
from mugrpo.config import ConfigError, TaskConfig
from mugrpo.errors import TaskError
from mugrpo.rollout.tasks import build_task

TINY = {"task": {"few_shot": [], "instruction": ""}, "rollout.max_new_tokens": 8, "train.autocast": "none",
        "train.progress": False, "eval.num_items": 0}


def frac_ones(prompts, completions, **kwargs):
    return [sum(ch == "1" for ch in c) / max(len(c), 1) for c in completions]


def test_reward_rises_with_a_python_reward_and_rows(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(64)]
    result = mugrpo.train({**TINY, "model.name": tiny_model_dir, "schedule.total_updates": 16, "optim.lr": 1e-2},
                          preset="grpo", reward_funcs=[frac_ones, "boxed_format"], reward_weights=[2.0, 1.0],
                          train_dataset=rows, run_dir=tmp_path / "run")
    stages = result.metrics("stage")
    # Random init emits '1' about 1 time in 100; boxed_format is 0 for a model that cannot write \boxed{}.
    assert stages[-1]["reward/frac_ones/mean"] > stages[0]["reward/frac_ones/mean"] + 0.1
    for s in stages:  # the logged sum is the weighted sum of the logged parts
        assert s["reward/boxed_format/mean"] == 0.0
        assert s["reward/mean"] == pytest.approx(2.0 * s["reward/frac_ones/mean"], abs=1e-6)
        assert s["reward/frac_ones/num_errors"] == 0
    # The run directory is the one `mugrpo train` writes; config.yaml names what it cannot hold.
    assert {"config.yaml", "metrics.jsonl", "stages", "checkpoints", "final_model"} <= set(os.listdir(result.run_dir))
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["task"]["kind"] == "rows" and saved["task"]["name"].startswith("python:64-rows-sha256-")
    # (the function's module as Python named it: test_api, or tests.test_api under pytest's importlib mode)
    assert saved["task"]["rewards"] == [{"fn": f"python:{frac_ones.__module__}.frac_ones", "weight": 2.0},
                                        {"fn": "boxed_format", "weight": 1.0}]
    assert result.final_model == result.run_dir / "final_model"


def _script(run_dir, model_dir, *extra, die_at=None):
    env = {**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}"}
    env.pop("MUGRPO_DIE_AT", None)
    if die_at:
        env["MUGRPO_DIE_AT"] = die_at
    return subprocess.run([sys.executable, str(TESTS / "api_script.py"), str(run_dir), model_dir, *extra], env=env,
                          capture_output=True, text=True)


@pytest.mark.slow  # ~20 s; the CLI's kills are kept
def test_python_run_killed_and_resumed_from_python_is_bitwise_identical(tmp_path, tiny_model_dir):
    ref = _script(tmp_path / "ref", tiny_model_dir)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _script(tmp_path / "run", tiny_model_dir, die_at="update:3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _script(tmp_path / "run", tiny_model_dir, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(str(tmp_path / "ref" / "final_model" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "final_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # The CLI cannot resume it (the functions are not in config.yaml), and says how to.
    cli = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(tmp_path / "ref")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert cli.returncode == 2 and "resume it from Python" in cli.stderr


def test_weighted_sum_and_failures_are_counted_per_function():
    def half(completion, answer, item):
        return 0.5

    def broken(prompts, completions, **kwargs):
        raise ValueError("nope")

    def short_list(prompts, completions, **kwargs):
        return [1.0]

    cfg = TaskConfig(size=6, eval_size=0, rewards=[{"fn": "boxed_format", "weight": 3.0}, {"fn": half, "weight": -2.0},
                                                   {"fn": broken}, {"fn": short_list, "name": "short"}])
    task = build_task(cfg)
    rewards, stats = task.score_all(["\\boxed{1}", "no answer"], task.items[:2])
    assert rewards.tolist() == [3.0 * 1 - 2.0 * 0.5, 3.0 * 0 - 2.0 * 0.5]
    assert stats.per_reward["broken"].num_errors == 2 and "ValueError: nope" in stats.first_error
    assert stats.per_reward["short"].num_errors == 2 and stats.per_reward["half"].num_errors == 0
    assert stats.num_errors == 4 and stats.num_unparsable == 1
    # Evaluation scores with correctness alone when it is among several rewards.
    task = build_task(TaskConfig(size=6, eval_size=0, rewards=[{"fn": "correctness"}, {"fn": half}]))
    right = f"\\boxed{{{task.items[0].answer}}}"
    assert task.score_all([right], task.items[:1])[0].tolist() == [1.5]
    assert task.score_eval([right], task.items[:1])[0].tolist() == [1.0]


def test_from_trl_converts_trl_and_verl_rows_in_one_call():
    rows = mugrpo.from_trl([
        {"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2", "level": 1},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "answer": "4"},
        {"prompt": "3+3?", "reward_model": {"ground_truth": "6"}, "data_source": "x"},
    ])
    assert rows[0] == {"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2", "level": 1, "answer": "2"}
    assert rows[1] == {"prompt": [{"role": "user", "content": "2+2?"}], "completion": "4", "answer": "4"}
    assert rows[2]["answer"] == "6" and rows[2]["data_source"] == "x"
    task = build_task(TaskConfig(eval_size=0), rows=rows)
    assert [i.prompt for i in task.items][2] == "3+3?" and task.items[0].messages[0]["content"] == "1+1?"
    assert [i.answer for i in task.items] == ["2", "4", "6"]
    with pytest.raises(ConfigError, match="no prompt"):
        mugrpo.from_trl([{"text": "hi"}])


def test_bad_input_gets_a_clear_error(tmp_path, tiny_model_dir):
    def two_args(completion, answer):
        return 1.0

    with pytest.raises(TaskError, match=r"two_args\(completion, answer\).*f\(prompts, completions, \*\*kwargs\)"):
        build_task(TaskConfig(size=4, rewards=[{"fn": two_args}]))
    with pytest.raises(TaskError, match="no column 'question' and no 'prompt' column; its columns are \\['text'\\]"):
        build_task(TaskConfig(), rows=[{"text": "a"}])
    with pytest.raises(TaskError, match="math-verify correctness needs an answer"):
        build_task(TaskConfig(eval_size=0), rows=[{"prompt": "a"}])
    build_task(TaskConfig(eval_size=0, rewards=[{"fn": frac_ones}]), rows=[{"prompt": "a"}])  # no answer needed
    with pytest.raises(ConfigError, match="2 values for 1 reward_funcs"):
        mugrpo.train(TINY, reward_funcs=[frac_ones], reward_weights=[1.0, 2.0], run_dir=tmp_path / "r")
    with pytest.raises(ConfigError, match="task.reward_fn and task.rewards are both set"):
        mugrpo.make_config({"task.reward_fn": "m:f", "task.rewards": [{"fn": "correctness"}]})
    with pytest.raises(ConfigError, match=r"task.rewards\[0\].weight"):
        mugrpo.make_config({"task.rewards": [{"fn": "correctness", "weight": float("nan")}]})
    with pytest.raises(ConfigError, match="unknown config key 'schedule.total_update'"):
        mugrpo.make_config({"schedule.total_update": 3})
    with pytest.raises(ConfigError, match="train_dataset must be a datasets.Dataset"):
        mugrpo.train(TINY, train_dataset=42, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_datasets_dataset_is_accepted(tmp_path, tiny_model_dir):
    import datasets

    # 10 rows, the last 2 (answers 9 and 10) held out; one stage of 2 updates x 4 prompts draws each of
    # the 8 training rows exactly once (a shuffled pass), so the stage's answers are exactly 1..8.
    ds = datasets.Dataset.from_list([{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)])
    result = mugrpo.train({**TINY, "model.name": tiny_model_dir, "task.eval_size": 2, "schedule.total_updates": 2,
                           "schedule.num_stages": 1, "schedule.prompts_per_update": 4, "rollout.group_size": 2},
                          reward_funcs=[frac_ones], train_dataset=ds, run_dir=tmp_path / "run")
    lines = [yaml.safe_load(line) for line in next((result.run_dir / "stages").glob("stage_000/*.jsonl"))
             .read_text().splitlines()]
    assert {line["answer"] for line in lines} == {str(i) for i in range(1, 9)}
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["task"]["kind"] == "rows" and saved["task"]["name"].startswith("python:10-rows-")


def test_rows_without_answers_train_when_no_reward_checks_answers(tmp_path, tiny_model_dir):
    # answer None in every row: a user reward needs none, so nothing is refused.
    rows = [{"prompt": f"question {i}", "answer": None} for i in range(8)]
    result = mugrpo.train({**TINY, "model.name": tiny_model_dir, "task.eval_size": 0, "schedule.total_updates": 1,
                           "schedule.num_stages": 1, "schedule.prompts_per_update": 4, "rollout.group_size": 2},
                          reward_funcs=[frac_ones], train_dataset=rows, run_dir=tmp_path / "run")
    assert len(result.metrics("update")) == 1


@pytest.mark.slow  # ~12 s
def test_example_script_runs(tmp_path, tiny_model_dir):
    example = TESTS.parent / "examples" / "train_api.py"
    r = subprocess.run([sys.executable, str(example), "--model", tiny_model_dir, "--updates", "2", "--run-dir",
                        str(tmp_path / "ex"), "--max-new-tokens", "8"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "correctness 0.000  boxed_format 0.000  concise" in r.stdout
    assert (tmp_path / "ex" / "final_model" / "config.json").is_file()
