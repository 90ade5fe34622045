"""Evaluating environment runs: the environment's reward and solved rate
under their own names; ``mugrpo eval`` takes ``env.*`` and ``train.threads`` overrides and writes
whole trajectories to ``--samples``; ``mugrpo.evaluate`` mirrors the command; ``task.reward_fn=none``
lets an environment that scores itself be the whole reward (refused without an environment)."""
import json

import pytest
from conftest import TESTS

import mugrpo
from mugrpo.cli import main
from mugrpo.errors import ConfigError
from mugrpo.observability.loggers import read_metrics

PROMPT = ["task.few_shot=[]", "task.instruction=", "train.threads=1"]
SELF_SCORING = ["task.env=self_scoring_envs:OneEighth", "task.reward_fn=none"]


@pytest.fixture(autouse=True)
def importable_envs(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def test_evaluate_reports_the_environment_reward_and_solved_rate(tiny_model_dir):
    # The task scores nothing (task.reward_fn=none); the environment gives 0.125 to every trajectory.
    report = mugrpo.evaluate(tiny_model_dir, overrides=[*PROMPT, *SELF_SCORING], k=2, num_items=4,
                             max_new_tokens=16)
    m = report["tasks"]["train"]
    assert m["greedy_acc"] == 0.0  # the task's score only, as before
    assert m["greedy_env_reward_mean"] == pytest.approx(0.125)
    assert m["greedy_reward_mean"] == pytest.approx(0.125)  # task (0) + environment: what training optimises
    assert m["greedy_solved_frac"] == 0.0  # 0.125 < eval correct_at (1.0)
    assert m["sample_env_reward_mean"] == pytest.approx(0.125) and m["sample_solved_frac"] == 0.0
    assert report["overall"]["greedy_env_reward_mean"] == pytest.approx(0.125)


def test_evaluate_refuses_an_unknown_option_naming_the_accepted_ones(tiny_model_dir):
    with pytest.raises(ConfigError, match="unknown option 'greedyy'.*temperature"):
        mugrpo.evaluate(tiny_model_dir, greedyy=False)


def test_mugrpo_eval_takes_env_overrides_and_writes_whole_trajectories(tiny_model_dir, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    args = ["eval", "--model", tiny_model_dir, "--num-items", "2", "--k", "0", "--max-new-tokens", "64",
            "--samples", str(samples), *PROMPT, "task.env=self_scoring_envs:FiveTurns"]
    assert main([*args, "env.max_turns=5"]) == 0  # was: "takes task.*, rollout.* and model.* overrides only"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        roles = [t["role"] for t in row["turns"]]
        assert roles == ["policy", "environment"] * 4 + ["policy"]  # the observations are visible
        assert [t["turn"] for t in row["turns"] if t["role"] == "policy"] == [0, 1, 2, 3, 4]
        assert "go on" in row["turns"][1]["text"]
        assert row["num_turns"] == 5 and row["env_reward"] == 1.0 and row["end"] == "done"
    assert "solved%" in capsys.readouterr().out  # the table shows the environment's solved rate
    # With the default env.max_turns (4) the fifth step never comes: no reward.
    assert main([*args]) == 0
    assert {json.loads(line)["env_reward"] for line in samples.read_text().splitlines()} == {0.0}


def test_a_self_scoring_environment_is_the_whole_reward_with_reward_fn_none(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "--run-dir", str(run_dir), f"model.name={tiny_model_dir}", *PROMPT, "rollout.max_new_tokens=8",
             "train.autocast=none", "train.progress=false", "schedule.total_updates=2", "schedule.num_stages=1",
             "eval.num_items=4", "eval.at_start=true"]
    assert main([*train, *SELF_SCORING]) == 0
    stage = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"][0]
    assert stage["reward/mean"] == pytest.approx(0.125)  # counted once: no task reward added
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and all(e["eval/greedy_env_reward_mean"] == pytest.approx(0.125) for e in evals)


def test_reward_fn_none_without_an_environment_is_refused(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), f"model.name={tiny_model_dir}", *PROMPT,
                 "train.progress=false", "task.reward_fn=none"]) == 2
    err = capsys.readouterr().err
    assert "task.reward_fn=none" in err and "task.env" in err and not run_dir.exists()
