"""Evaluation skips an item whose environment cannot be made or reset, counted in
``env/num_items_skipped`` (``eval/env/num_items_skipped`` in a run's eval record), and goes on with
the others, as training's stages do; an evaluation where every item fails stops naming the
environment and the first error. Before: the first such item ended the evaluation (and the run)."""
import json
import string

import pytest
from conftest import TINY_OVERRIDES

import mugrpo
from mugrpo.cli import main
from mugrpo.config import load_config
from mugrpo.errors import TaskError
from mugrpo.observability.loggers import read_metrics
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.pipeline import train

PROMPT = ["task.few_shot=[]", "task.instruction=", "train.threads=1"]
BAD = {"bad"}
"""The questions whose environment's reset raises (a test may set its own)."""


class FailsOnBad(Environment):
    """One turn, reward 0.125; ``reset`` raises on a question in BAD."""

    max_turns = 1
    stop = tuple(string.printable)

    def reset(self, item, seed):
        if item.question in BAD:
            raise RuntimeError(f"reset broke on {item.question!r}")
        return None

    def step(self, action):
        return StepResult([], reward=0.125, done=True)


class NeverMade(FailsOnBad):
    def __init__(self):
        raise RuntimeError("constructor broke")


def _rows(tmp_path, questions):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n" for i, q in enumerate(questions)))
    return f"items={path}"


def test_eval_skips_an_item_whose_environment_fails_counted_and_goes_on(tiny_model_dir, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    report = mugrpo.evaluate(tiny_model_dir, _rows(tmp_path, ["1 + 1", "bad", "2 + 2"]), k=2, max_new_tokens=8,
                             overrides=[*PROMPT, f"task.env={__name__}:FailsOnBad"], samples=samples,
                             out=tmp_path / "eval.json")
    m = report["tasks"]["items"]
    assert m["env/num_items_skipped"] == 2  # the bad item, once in each mode (greedy, 2 samples)
    assert m["num_items"] == 2 and m["env/num_done"] == 2 + 2 * 2  # the trajectories that ran
    assert m["greedy_env_reward_mean"] == pytest.approx(0.125)  # over the items that ran
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted((r["mode"], r["item"], r["answer"]) for r in rows) == [
        ("greedy", 0, "0"), ("greedy", 2, "2"), ("sample", 0, "0"), ("sample", 0, "0"), ("sample", 2, "2"),
        ("sample", 2, "2")]  # the responses answer their own items: the skipped one's index is not reused
    assert json.loads((tmp_path / "eval.json").read_text())["tasks"]["items"]["env/num_items_skipped"] == 2
    err = capsys.readouterr().err
    assert "2 item start(s) of 6 skipped" in err and "RuntimeError: reset broke on 'bad'" in err
    assert "Traceback" in err


def test_eval_where_every_item_fails_stops_naming_the_environment_and_the_first_error(tiny_model_dir, tmp_path,
                                                                                      capsys):
    items = _rows(tmp_path, ["bad"])
    with pytest.raises(TaskError, match=r"(?s)every item of this evaluation failed to start its environment "
                                        r"\(FailsOnBad\).*1 item start\(s\) skipped.*reset broke on 'bad'"):
        mugrpo.evaluate(tiny_model_dir, items, k=0, max_new_tokens=8,
                        overrides=[*PROMPT, f"task.env={__name__}:FailsOnBad"])
    # The command: exit 2 with the message. (A constructor broken from the first instance is already
    # refused by the start-up check: NeverMade never reaches the items.)
    assert main(["eval", "--model", tiny_model_dir, "--task", items, "--k", "0", "--max-new-tokens", "8", *PROMPT,
                 f"task.env={__name__}:FailsOnBad"]) == 2
    assert "every item of this evaluation failed to start its environment (FailsOnBad)" in capsys.readouterr().err
    assert main(["eval", "--model", tiny_model_dir, "--task", items, "--k", "0", *PROMPT,
                 f"task.env={__name__}:NeverMade"]) == 2
    assert "making the environment (NeverMade) at start failed: RuntimeError: constructor broke" in \
        capsys.readouterr().err


def test_a_runs_evaluation_skips_the_failing_item_and_records_it(tmp_path, tiny_model_dir, monkeypatch):
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES,
                                            f"task.env={__name__}:FailsOnBad", "eval.num_items=3",
                                            "eval.num_samples=0", "schedule.total_updates=1",
                                            # threads: BAD is patched in this process only
                                            "schedule.num_stages=1", "env.step_isolation=thread"])
    from mugrpo.rollout.tasks import build_task

    first_held_out = build_task(cfg.task).eval_items[0].question
    monkeypatch.setattr(f"{__name__}.BAD", {first_held_out})
    train(cfg, tmp_path / "run")
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and all(r["eval/env/num_items_skipped"] == 1 and r["eval/num_items"] == 2 for r in evals)
    stages = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "stage"]
    assert stages[0]["env/num_items_skipped"] == 0  # a held-out question never comes up in training
