"""The adaptive stage (schedule.adaptive): the guard's decision by hand, the plan's bounds, bad values,
and end to end on the tiny model: a guard that must trip ends every stage where the arithmetic says,
one that never trips is bitwise the fixed schedule, and a kill anywhere resumes bitwise."""
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import TINY_OVERRIDES
from safetensors.torch import load_file
from kit.test_resume import _env

from mugrpo.algo.adaptive import end_reason, guard_trips, stage_length
from mugrpo.config import ConfigError, load_config
from mugrpo.observability.loggers import read_metrics
from mugrpo.config.plan import format_plan, make_plan
from mugrpo.pipeline import train


def _schedule(guard="kl", kl_max=0.05, neg_min=0.8, min_updates=1):
    return SimpleNamespace(adaptive=guard, adaptive_kl_max=kl_max, adaptive_neg_ratio_min=neg_min,
                           adaptive_min_updates=min_updates)


# ---------------------------------------------------------------------------------------------
# The decision, by hand.


@pytest.mark.parametrize("guard,kl,neg,expected", [
    ("kl", 0.06, 1.0, "kl"),                # 0.06 > 0.05
    ("kl", 0.05, 0.1, None),                # not strictly above; the ratio is not looked at
    ("neg_ratio", 9.0, 0.79, "neg_ratio"),  # 0.79 < 0.8; KL ignored
    ("neg_ratio", 0.0, 0.8, None),          # not strictly below
    ("kl_or_neg_ratio", 0.01, 0.5, "neg_ratio"),
    ("kl_or_neg_ratio", 0.2, 0.5, "kl"),    # both trip: kl is named
    ("kl_or_neg_ratio", math.nan, math.nan, None),  # nothing measured (e.g. no A<0 token): no evidence
    ("none", 9.0, 0.0, None),
])
def test_guard_trips_by_hand(guard, kl, neg, expected):
    metrics = {"loss/kl_behavior": kl, "loss/ratio_mean_neg": neg}
    assert guard_trips(_schedule(guard), metrics) == expected


def test_end_reason_respects_min_updates_mu_and_budget():
    drifted = {"loss/kl_behavior": 1.0}
    s = _schedule("kl", min_updates=3)
    # mu 8, stage starting at update 0 of a 32-update budget: may run 8.
    assert stage_length(8, 32, 0) == 8 and stage_length(8, 32, 27) == 5
    assert [end_reason(s, drifted, j, 8, 8) for j in (1, 2, 3)] == [None, None, "kl"]
    assert end_reason(s, {"loss/kl_behavior": 0.0}, 8, 8, 8) == "mu"
    assert end_reason(s, drifted, 5, 8, 5) == "budget"   # the budget ends first, whatever the guard says
    assert end_reason(_schedule("none"), drifted, 7, 8, 8) is None


# ---------------------------------------------------------------------------------------------
# Config and plan.


def test_adaptive_plan_states_the_stage_count_as_a_range():
    # U 32, 4 stages -> mu 8 is the longest stage; min 3 updates -> at most ceil(32 / 3) = 11 stages.
    cfg = load_config("mu-grpo", overrides=["schedule.adaptive=kl", "schedule.adaptive_min_updates=3"])
    p = make_plan(cfg)
    assert (p.num_stages, p.weight_syncs, p.min_stages, p.max_stages, p.updates_per_stage) == (None, None, 4, 11, 8)
    text = format_plan(p, cfg)
    assert "variable, 4 .. 11" in text and "3 .. 8" in text and "KL(behaviour -> current) > 0.05" in text
    fixed = make_plan(load_config("mu-grpo"))
    assert (fixed.num_stages, fixed.min_stages, fixed.max_stages) == (4, 4, 4)


@pytest.mark.parametrize("override,needle", [
    ("schedule.adaptive=drift", "schedule.adaptive"),
    ("schedule.adaptive_kl_max=0", "schedule.adaptive_kl_max"),
    ("schedule.adaptive_kl_max=nan", "schedule.adaptive_kl_max"),
    ("schedule.adaptive_kl_max=inf", "schedule.adaptive_kl_max"),
    ("schedule.adaptive_neg_ratio_min=0", "schedule.adaptive_neg_ratio_min"),
    ("schedule.adaptive_neg_ratio_min=1.5", "schedule.adaptive_neg_ratio_min"),
    ("schedule.adaptive_min_updates=0", "schedule.adaptive_min_updates"),
    ("schedule.adaptive_min_updates=9", "adaptive_min_updates=9 exceeds the maximum stage length mu=8"),
])
def test_bad_adaptive_values_are_refused_by_name(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("mu-grpo", overrides=["schedule.adaptive=kl", override])


# ---------------------------------------------------------------------------------------------
# End to end on the tiny model.

BASE = ["schedule.total_updates=8", "schedule.num_stages=1", "optim.lr=1e-2", "train.deterministic=true",
        "train.threads=1", "checkpoint.every_updates=2", "train.save_stage_text=false"]


def _train(tmp_path, model_dir, name, *extra):
    cfg = load_config("mu-grpo", overrides=[f"model.name={model_dir}", *TINY_OVERRIDES, *BASE, *extra])
    run_dir = tmp_path / name
    train(cfg, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    return run_dir, [r for r in records if r["kind"] == "update"], [r for r in records if r["kind"] == "stage"]


@pytest.mark.slow  # ~11 s; the guard's decisions are unit-tested above
def test_a_guard_that_must_trip_ends_every_stage_at_min_updates(tmp_path, tiny_model_dir):
    # kl_max 1e-12: any update after the first step of a stage has KL > 0, so each stage ends as soon as
    # adaptive_min_updates = 3 allow: stages of 3, 3, then 2 (8 - 6: the budget ends the last one).
    run_dir, updates, stages = _train(tmp_path, tiny_model_dir, "trip", "schedule.adaptive=kl",
                                      "schedule.adaptive_kl_max=1e-12", "schedule.adaptive_min_updates=3")
    assert [r["update"] for r in updates] == list(range(1, 9))  # the budget U, exactly
    assert [r["stage"] for r in updates] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [r["update_in_stage"] for r in updates] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert [(s["stage"], s["update"], s["stage/num_updates"], s["stage/end_reason"], s["stage/ended_early"])
            for s in stages] == [(0, 3, 3, "kl", 1.0), (1, 6, 3, "kl", 1.0), (2, 8, 2, "budget", 0.0)]
    # Each stage generated prompts for mu = 8 updates (64 groups) and drew 3 x 8 (or 2 x 8) of them.
    assert [s["stage/passes_used"] for s in stages] == [24 / 64, 24 / 64, 16 / 64]
    assert all(updates[i]["loss/kl_behavior"] > 1e-12 for i in (2, 5))  # the guard's evidence is in the log
    assert sorted(p.name for p in (run_dir / "stages").iterdir()) == ["stage_000", "stage_001", "stage_002"]
    # Checkpoints: mid-stage at global updates 2 and 4 (every_updates=2 counts the run's updates), else the
    # stage ends (6 ends stage 1, 8 the run).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "ckpt_000008_s003_u00000"


@pytest.mark.slow  # ~13 s
def test_the_first_update_of_a_stage_never_trips_the_kl_guard(tmp_path, tiny_model_dir):
    # At a stage's first update current = behaviour (KL < 1e-9, test_trainer), so kl_max 1e-6 with
    # min 1 update cannot end a stage there; the second update, one lr-1e-2 step later, drifts past it.
    _, updates, stages = _train(tmp_path, tiny_model_dir, "second", "schedule.adaptive=kl",
                                "schedule.adaptive_kl_max=1e-6", "schedule.adaptive_min_updates=1")
    assert [s["stage/num_updates"] for s in stages] == [2, 2, 2, 2]
    assert [s["stage/end_reason"] for s in stages] == ["kl", "kl", "kl", "budget"]
    assert all(r["loss/kl_behavior"] <= 1e-6 for r in updates if r["update_in_stage"] == 0)


def test_a_guard_that_never_trips_is_bitwise_the_fixed_schedule(tmp_path, tiny_model_dir):
    fixed_dir, fixed, fixed_stages = _train(tmp_path, tiny_model_dir, "fixed", "schedule.num_stages=2")
    ada_dir, ada, ada_stages = _train(tmp_path, tiny_model_dir, "never", "schedule.num_stages=2",
                                      "schedule.adaptive=kl_or_neg_ratio", "schedule.adaptive_kl_max=1e9",
                                      "schedule.adaptive_neg_ratio_min=1e-9")
    assert [r["loss/policy"] for r in ada] == [r["loss/policy"] for r in fixed]
    assert [s["stage/end_reason"] for s in ada_stages] == [s["stage/end_reason"] for s in fixed_stages] == ["mu"] * 2
    a, b = (load_file(str(d / "final_model" / "model.safetensors")) for d in (fixed_dir, ada_dir))
    assert all(a[k].equal(b[k]) for k in a)
    assert sorted(p.name for p in (ada_dir / "checkpoints").iterdir()) == \
        sorted(p.name for p in (fixed_dir / "checkpoints").iterdir())


# Kill and resume, mirroring tests/kit/test_resume.py: stages of 3, 3, 2 as in the first end-to-end test.
ADAPTIVE = ["schedule.adaptive=kl", "schedule.adaptive_kl_max=1e-12", "schedule.adaptive_min_updates=3"]


def _cmd(run_dir, model_dir):
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={model_dir}",
            *TINY_OVERRIDES, *BASE, *ADAPTIVE]


def _resume_and_compare(run_dir, reference):
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = (load_file(str(d / "final_model" / "model.safetensors")) for d in (reference, run_dir))
    assert ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
    ref_m, got_m = (read_metrics(d / "metrics.jsonl") for d in (reference, run_dir))
    assert [r["loss/policy"] for r in got_m if r["kind"] == "update"] == \
        [r["loss/policy"] for r in ref_m if r["kind"] == "update"]
    assert [(r["stage"], r["stage/num_updates"], r["stage/end_reason"]) for r in got_m if r["kind"] == "stage"] == \
        [(0, 3, "kl"), (1, 3, "kl"), (2, 2, "budget")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("adaptive_ref") / "run"
    r = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("die_at", [
    # Killed after the update whose guard ends the stage, before that stage-end checkpoint: the resume
    # loads the mid-stage checkpoint (every_updates=2) and must replay the update and decide the same.
    pytest.param("update:6", marks=pytest.mark.slow),  # stage 1 (last checkpoint: update 4, in-stage 1)
    pytest.param("update:3", marks=pytest.mark.slow),  # stage 0 (last checkpoint: update 2, in-stage 2)
])
def test_killed_mid_adaptive_stage_resumes_bitwise(tmp_path, tiny_model_dir, reference, die_at):
    run_dir = tmp_path / "run"
    killed = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env(die_at), capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    _resume_and_compare(run_dir, reference)


@pytest.mark.slow  # ~27 s
def test_sigterm_at_a_guard_trip_checkpoints_the_stage_end(tmp_path, tiny_model_dir, reference):
    # SIGTERM right after update 3, which trips the guard: the stop lands on the stage-end checkpoint
    # (stage 1, nothing done in it), not a mid-stage one from which stage 0 would go on.
    run_dir = tmp_path / "run"
    stopped = subprocess.run(_cmd(run_dir, tiny_model_dir), env={**_env(), "MUGRPO_STOP_AT": "update:3"},
                             capture_output=True, text=True)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "ckpt_000003_s001_u00000"
    _resume_and_compare(run_dir, reference)
