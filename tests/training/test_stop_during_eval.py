"""SIGTERM during an evaluation inside training: the stop lands between the
evaluation's decode steps, not after the whole evaluation. The evaluation is abandoned without a
record and the resumed run runs it at its start: after the in-loop update's checkpoint, or after the
stage's record and stage-end checkpoint (marked pending in it; at the last stage the run does not
finish without it). Each resumed run equals the uninterrupted one: weights bitwise, and the same
update and evaluation records. Real subprocess runs of the tiny model; stops placed by ``MUGRPO_STOP_AT``."""
import subprocess
import sys

import pytest
from conftest import TINY_OVERRIDES
from kit.test_resume import _env, _final_params

from mugrpo.observability.loggers import read_metrics

# 16 held-out items, greedy, up to 8 tokens: an evaluation is 8 decode steps (8 heartbeats) and
# one finished batch, so "eval:3" lands inside the first evaluation, "eval:12" inside the second.
EVAL = ["eval.num_items=16", "eval.at_start=true", "eval.every_updates=2", "eval.every_stages=1"]


def _cmd(run_dir, model_dir, stages=2):
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
            *TINY_OVERRIDES, "schedule.total_updates=4", f"schedule.num_stages={stages}", "optim.lr=1e-2",
            "train.deterministic=true", "train.threads=1", *EVAL]


def _run(cmd, stop_at=None):
    env = _env()
    if stop_at:
        env["MUGRPO_STOP_AT"] = stop_at
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def _records(run_dir, kind):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    r = _run(_cmd(run_dir, tiny_model_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    # the start (update 0), then every 2 updates: each a stage end here (mu = 2), evaluated by the stage end
    assert [e["update"] for e in _records(run_dir, "eval")] == [0, 2, 4]
    return run_dir


def _assert_same_run(reference, run_dir):
    ref, got = _final_params(reference), _final_params(run_dir)
    assert ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
    for kind, key in (("update", "loss/policy"), ("eval", "eval/greedy_acc"), ("eval", "eval/response_len_mean")):
        assert [(r["update"], r[key]) for r in _records(run_dir, kind)] == [
            (r["update"], r[key]) for r in _records(reference, kind)]


def _stop_then_resume(tmp_path, model_dir, stop_at, stages=2):
    run_dir = tmp_path / "run"
    stopped = _run(_cmd(run_dir, model_dir, stages), stop_at=stop_at)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    before = {"evals": [e["update"] for e in _records(run_dir, "eval")],
              "updates": [u["update"] for u in _records(run_dir, "update")],
              "stages": [s["stage"] for s in _records(run_dir, "stage")],
              "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt_*"))}
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return run_dir, before


@pytest.mark.slow  # ~20 s; the in-loop and last evaluations are kept
def test_a_stop_inside_the_starting_evaluation_ends_it_there(tmp_path, tiny_model_dir, reference):
    run_dir, before = _stop_then_resume(tmp_path, tiny_model_dir, "eval:3")
    # Stopped inside the evaluation of update 0: nothing logged, nothing generated.
    assert before == {"evals": [], "updates": [], "stages": [], "checkpoints": []}
    _assert_same_run(reference, run_dir)


@pytest.mark.slow  # ~20 s; the in-loop case is kept
def test_a_stop_inside_a_stage_end_evaluation_abandons_it_and_the_resume_evaluates_first(tmp_path, tiny_model_dir,
                                                                                          reference):
    run_dir, before = _stop_then_resume(tmp_path, tiny_model_dir, "eval:12")
    # Inside stage 0's end evaluation (update 2): the stage is logged and its end checkpointed as
    # without the stop, the evaluation is not (the checkpoint says it is pending).
    assert before == {"evals": [0], "updates": [1, 2], "stages": [0], "checkpoints": ["ckpt_000002_s001_u00000"]}
    _assert_same_run(reference, run_dir)


@pytest.mark.slow  # ~39 s; tests/training/test_trainer_stop_after_first_eval.py keeps a stop inside an evaluation
def test_a_stop_inside_the_last_evaluation_resumes_to_evaluate_and_export(tmp_path, tiny_model_dir, reference):
    # Inside the last stage's end evaluation (update 4, the end of the run): the run does not finish
    # without it; the resume evaluates, then exports the final model.
    run_dir, before = _stop_then_resume(tmp_path, tiny_model_dir, "eval:23")
    assert before == {"evals": [0, 2], "updates": [1, 2, 3, 4], "stages": [0, 1],
                      "checkpoints": ["ckpt_000002_s001_u00000", "ckpt_000004_s002_u00000"]}
    _assert_same_run(reference, run_dir)


@pytest.mark.slow  # ~47 s; the stop inside the last evaluation keeps the default tier's check
def test_a_stop_inside_an_in_loop_evaluation_abandons_it_and_the_resume_evaluates_again(tmp_path, tiny_model_dir):
    # One stage of 4 updates: the evaluation at update 2 runs inside the stage's loop.
    ref_dir = tmp_path / "ref"
    assert _run(_cmd(ref_dir, tiny_model_dir, stages=1)).returncode == 0
    assert [e["update"] for e in _records(ref_dir, "eval")] == [0, 2, 4]
    run_dir, before = _stop_then_resume(tmp_path, tiny_model_dir, "eval:12", stages=1)
    # Abandoned without a record; the update it followed is checkpointed (the stop's checkpoint).
    assert before == {"evals": [0], "updates": [1, 2], "stages": [], "checkpoints": ["ckpt_000002_s000_u00002"]}
    _assert_same_run(ref_dir, run_dir)
