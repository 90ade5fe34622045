"""mugrpo.rollout.tasks with ``task.eval_path``: a held-out file named on
the command line, as ``eval_dataset=`` names one from Python."""
import json

import pytest
from conftest import TINY_OVERRIDES

from mugrpo.config import ConfigError, load_config
from mugrpo.errors import TaskError
from mugrpo.rollout.tasks import build_task


def _rows(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n" for i, q in enumerate(questions)))
    return str(path)


def test_a_math_file_trains_on_every_row_and_holds_out_the_eval_file(tmp_path):
    train = _rows(tmp_path / "train.jsonl", [f"q{i}" for i in range(10)])
    held = _rows(tmp_path / "held.jsonl", ["h0", "h1", "q3"])
    cfg = load_config(overrides=["task.kind=math", f"task.name={train}", f"task.eval_path={held}"])
    task = build_task(cfg.task)
    assert [i.question for i in task.eval_items] == ["h0", "h1", "q3"]
    # every row of the training file trains (none held out at its tail), except the one whose question is held out
    assert [i.question for i in task.items] == [f"q{i}" for i in range(10) if i != 3]
    # without the file: the last eval_size rows (at most half) are held out
    plain = build_task(load_config(overrides=["task.kind=math", f"task.name={train}", "task.eval_size=2"]).task)
    assert [i.question for i in plain.eval_items] == ["q8", "q9"]


def test_eval_size_cuts_the_eval_file(tmp_path):
    held = _rows(tmp_path / "held.jsonl", ["h0", "h1", "h2"])
    train = _rows(tmp_path / "train.jsonl", [f"q{i}" for i in range(4)])
    cfg = load_config(overrides=["task.kind=math", f"task.name={train}", f"task.eval_path={held}", "task.eval_size=2"])
    assert [i.question for i in build_task(cfg.task).eval_items] == ["h0", "h1"]


def test_python_rows_take_the_eval_file_too_but_not_with_eval_dataset(tmp_path):
    held = _rows(tmp_path / "held.jsonl", ["h0"])
    cfg = load_config(overrides=[f"task.eval_path={held}"])
    rows = [{"question": f"q{i}", "answer": "1"} for i in range(4)]
    task = build_task(cfg.task, rows)
    assert [i.question for i in task.items] == ["q0", "q1", "q2", "q3"]
    assert [i.question for i in task.eval_items] == ["h0"]
    with pytest.raises(TaskError, match="task.eval_path and eval_dataset both name the held-out rows"):
        build_task(cfg.task, rows, [{"question": "x", "answer": "1"}])


def test_a_bad_eval_path_is_named(tmp_path):
    with pytest.raises(ConfigError, match="task.eval_path"):
        load_config(overrides=["task.eval_path=''"])
    with pytest.raises(TaskError, match="does not exist"):
        build_task(load_config(overrides=[f"task.eval_path={tmp_path / 'missing.jsonl'}"]).task)
    with pytest.raises(TaskError, match="task.eval_path='data.txt': a local file ending in .jsonl"):
        build_task(load_config(overrides=["task.eval_path=data.txt"]).task)


def test_mugrpo_train_evaluates_on_the_named_file(tmp_path, tiny_model_dir):
    from mugrpo.cli import main
    from mugrpo.observability.loggers import read_metrics

    held = _rows(tmp_path / "held.jsonl", ["1+1", "2+2", "3+3"])
    run_dir = tmp_path / "run"
    assert main(["train", f"model.name={tiny_model_dir}", *TINY_OVERRIDES, "--run-dir", str(run_dir),
                 f"task.eval_path={held}", "schedule.total_updates=1", "schedule.num_stages=1",
                 "schedule.prompts_per_update=2", "rollout.group_size=2", "eval.at_start=true",
                 "train.save_final_model=false"]) == 0
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and all(r["eval/num_items"] == 3 for r in evals)
