"""A killed run resumed leaves one evaluation record per evaluated update in metrics.jsonl: the evaluations the resumed run repeats at its start are dropped from the old records."""
import json
import subprocess
import sys

import pytest
from conftest import TINY_OVERRIDES
from kit.test_resume import _env

from mugrpo.config import EvalConfig
from mugrpo.kit.lifecycle import truncate_metrics
from mugrpo.stages.state import RLState, kept_after_resume


def _train(run_dir, model_dir, *extra, die_at=None):
    cmd = [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
           *TINY_OVERRIDES, "schedule.total_updates=4", "schedule.num_stages=2", "schedule.prompts_per_update=2",
           "rollout.group_size=2", "train.threads=1", "eval.num_items=2", "train.save_final_model=false", *extra]
    return subprocess.run(cmd, env=_env(die_at), capture_output=True, text=True)


def _resume(run_dir):
    return subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                          capture_output=True, text=True)


def _eval_updates(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["update"] for r in records if r["kind"] == "eval"]


@pytest.mark.parametrize("extra, die_at, expected", [
    # Killed in stage 0's generation: the initial evaluation is logged, no checkpoint exists yet. The
    # resumed run starts over and evaluates the initial policy again.
    pytest.param((), "generate:1", [0, 2, 4], marks=pytest.mark.slow),
    # Every 2 updates, checkpoints too; killed after update 3: ckpt at update 2 (after its evaluation).
    # The resumed run evaluates update 2 again at its start (2 is a multiple of eval.every_updates).
    pytest.param(("eval.every_updates=1", "eval.every_stages=0", "schedule.num_stages=1", "checkpoint.every_updates=2"),
                 "update:3", [0, 1, 2, 3, 4], marks=pytest.mark.slow),
])
def test_a_killed_and_resumed_run_logs_each_evaluation_once(tmp_path, tiny_model_dir, extra, die_at, expected):
    run_dir = tmp_path / "run"
    killed = _train(run_dir, tiny_model_dir, *extra, die_at=die_at)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert 0 in _eval_updates(run_dir)  # the evaluation before the kill was logged
    resumed = _resume(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _eval_updates(run_dir) == expected


def _records(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_truncate_keeps_a_stage_end_evaluation_the_resume_does_not_repeat(tmp_path):
    # eval.every_stages=1, every_updates=0: the evaluation at update 2 ended stage 0 and is not run again
    # at the resumed start, so it stays; the update-0 one is repeated only at update 0.
    eval_cfg = EvalConfig(every_updates=0, at_start=True)
    path = tmp_path / "metrics.jsonl"
    _records(path, {"kind": "eval", "stage": 0, "update": 0}, {"kind": "update", "stage": 0, "update": 1},
             {"kind": "update", "stage": 0, "update": 2}, {"kind": "eval", "stage": 0, "update": 2},
             {"kind": "stage", "stage": 0, "update": 2}, {"kind": "update", "stage": 1, "update": 3})
    state = RLState(stage=1, update=2)
    truncate_metrics(path, state.update, kept_after_resume(eval_cfg, state))
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["update"]) for r in kept] == [("eval", 0), ("update", 1), ("update", 2), ("eval", 2),
                                                       ("stage", 2)]
    truncate_metrics(path, 0, kept_after_resume(eval_cfg, RLState()))  # no checkpoint: the run starts over, nothing of it is kept
    assert not path.exists()
