"""Stages generated ahead (schedule.async_stages, mugrpo/stages/ahead.py): the lag bound in the
recorded policy versions and metrics, the idle ledger's arithmetic, the config's bounds and
refusals, and a kill during generation ahead resumed bitwise (the HF engine in process, tiny model)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.config import ConfigError, load_config
from mugrpo.config.plan import format_plan, make_plan
from mugrpo.observability.loggers import read_metrics
from mugrpo.stages.state import RLState
from mugrpo.stages.ahead import AheadStages, IdleLedger, PolicySnapshot, lag_metrics
from mugrpo.stages.data import StageData

# 4 stages of 2 updates; each stage generates 32 prompts x G 8 (4 generation batches of 64) and
# trains on 2 x 8 of them: generating a stage takes longer than optimising one.
RUN = [*TINY_OVERRIDES, "schedule.total_updates=8", "schedule.num_stages=4", "rollout.prompts_per_stage=32",
       "optim.lr=1e-2", "train.deterministic=true", "train.threads=1", "checkpoint.every_updates=0",
       "eval.num_items=8"]  # evaluated at the start and each stage's end, on the engine the generating thread uses


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **extra}
    for key in ("MUGRPO_DIE_AT", "MUGRPO_STOP_AT"):
        if key not in extra:
            env.pop(key, None)
    return env


def _train(run_dir, model_dir, *extra, **env):
    return subprocess.run([sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir),
                           f"model.name={model_dir}", *RUN, *extra], env=_env(**env), capture_output=True, text=True)


def _stages(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"]


def _versions(run_dir, stage):
    path = run_dir / "stages" / f"stage_{stage:03d}" / "rollouts_rank0.safetensors"
    return StageData.load(path).versions(stage)


# ---------------------------------------------------------------------------------------------
# Pure parts.


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.unit
def test_idle_ledger_splits_waits_and_idle_periods_by_stage_interval():
    clock = _Clock()
    ledger = IdleLedger(clock)
    ledger.open()                 # interval 0 begins at t=0
    ledger.engine_idle()          # generator idle from 0 ...
    clock.now = 1.0
    ledger.engine_busy()          # ... to 1: 1 s idle
    ledger.add_trainer_wait(2.0)  # the trainer waited 2 s (0 -> 2, say)
    clock.now = 4.0
    ledger.engine_idle()          # idle again from 4, still idle when the interval closes at 6: 2 s
    clock.now = 6.0
    first = ledger.close()
    # wall 6; wait 2 -> 2/6; idle 1 + 2 = 3 -> 3/6
    assert first["perf/stage_wall_s"] == 6.0 and first["perf/trainer_wait_s"] == 2.0
    assert first["perf/engine_idle_s"] == 3.0
    assert first["perf/trainer_idle_frac"] == pytest.approx(1 / 3) and first["perf/engine_idle_frac"] == 0.5
    clock.now = 7.0
    ledger.engine_busy()          # the idle period 4 -> 7: its 6 -> 7 part (1 s) falls in interval 1
    clock.now = 10.0
    second = ledger.close()
    # wall 10 - 6 = 4; no wait; idle 1 -> 1/4
    assert (second["perf/stage_wall_s"], second["perf/trainer_wait_s"], second["perf/engine_idle_s"]) == (4.0, 0.0, 1.0)
    assert (second["perf/trainer_idle_frac"], second["perf/engine_idle_frac"]) == (0.0, 0.25)


@pytest.mark.unit
def test_lag_metrics_count_stages_between_the_version_and_the_stage():
    # stage 2, versions 0, 0, 1, 1 -> lags 2, 2, 1, 1: max 2, mean 6 / 4 = 1.5
    assert lag_metrics([0, 0, 1, 1], 2) == {"stage/policy_lag_max": 2, "stage/policy_lag_mean": 1.5}


def _data(versions=None):
    return StageData([[1, 2], [3]], [[4], [5, 6], [7], [8]], [[-0.5], [-0.1, -0.2], [-0.3], [-0.4]],
                     torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, -1.0, 0.0, 0.0]),
                     torch.tensor([True, False, True, True]), [10, 11], 2, policy_versions=versions)


@pytest.mark.unit
def test_policy_versions_are_persisted_and_old_shards_read_as_the_stage(tmp_path):
    _data([3, 3, 4, 4]).save(tmp_path / "new.safetensors")
    loaded = StageData.load(tmp_path / "new.safetensors")
    assert loaded.policy_versions == [3, 3, 4, 4] and loaded.versions(5) == [3, 3, 4, 4]
    assert loaded.subset([1]).policy_versions == [4, 4]
    _data().save(tmp_path / "old.safetensors")  # as the synchronous loop (and older mugrpo) writes it
    old = StageData.load(tmp_path / "old.safetensors")
    assert old.policy_versions is None and old.versions(5) == [5, 5, 5, 5]


@pytest.mark.unit
@pytest.mark.parametrize("value", ["-1", "3"])
def test_async_stages_out_of_bounds_is_a_config_error_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"schedule\.async_stages.*0 \.\. 2"):
        load_config("mu-grpo", overrides=[f"schedule.async_stages={value}"])


@pytest.mark.unit
def test_async_stages_with_trainer_logprobs_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"schedule\.async_stages=1 and loss\.behavior_logprobs=trainer"):
        load_config("mu-grpo", overrides=["schedule.async_stages=1", "loss.behavior_logprobs=trainer"])


@pytest.mark.unit
def test_plan_shows_the_lag_bound():
    cfg = load_config("mu-grpo", overrides=["schedule.async_stages=2"])
    rows = {line[:31].strip(): line[31:].strip() for line in format_plan(make_plan(cfg), cfg).splitlines()}
    # mu = 32 / 4 = 8: a lag of 2 stages is 16 updates, plus up to 7 within the stage
    assert rows["stages generated ahead"].startswith("2 (stage s + 1 .. s + 2 generated while stage s is optimised")
    assert "policy lag 0 .. 2 stages, i.e. up to 16 + 7 updates" in rows["stages generated ahead"]
    off = load_config("mu-grpo")
    assert "0 (synchronous" in format_plan(make_plan(off), off)


def test_bad_async_stages_exits_2_at_start(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mugrpo", "plan", "schedule.async_stages=3"], env=_env(),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "schedule.async_stages=3" in r.stderr, r.stderr[-2000:]


def _source(tmp_path, k=1):
    """An AheadStages over stage folders in tmp_path, whose policy is a 2x2 linear layer of ones."""
    policy = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.ones_(policy.weight)
    inner = SimpleNamespace(engine=SimpleNamespace(ledger=IdleLedger()),
                            store=SimpleNamespace(stage_dir=lambda t: tmp_path / f"stage_{t:03d}"))
    return AheadStages(inner, plan=None, k=k, policy=policy), policy


@pytest.mark.unit
def test_a_stop_saves_the_in_flight_stages_weights_and_the_resume_generates_from_them(tmp_path):
    source, policy = _source(tmp_path)
    start = PolicySnapshot.take(policy, version=1)  # stage 1's start: the weights stage 2 is requested from
    source._pending = {2: start}
    source.close()  # the run stops in stage 1 with stage 2 in flight
    assert (tmp_path / "stage_002" / "behavior_weights.safetensors").is_file()
    resumed, policy = _source(tmp_path)
    with torch.no_grad():
        policy.weight.fill_(5.0)  # the resumed weights: stage 1 after some of its updates
    snaps = resumed._snapshots(RLState(stage=1, update=3, update_in_stage=1), [2])
    assert snaps[2].version == 1 and snaps[2].tensors["weight"].equal(torch.ones(2, 2))


@pytest.mark.unit
def test_a_kill_that_lost_the_weights_generates_from_the_resumed_ones_and_says_so(tmp_path, capsys):
    source, policy = _source(tmp_path)
    snaps = source._snapshots(RLState(stage=1, update=3, update_in_stage=1), [2])
    # version 1 (stage 1 after 1 update): lag 2 - 1 = 1 recorded, the weights a stage fresher than meant
    assert snaps[2].version == 1 and not snaps[2].at_start
    out = capsys.readouterr().out
    assert ("[mugrpo] resume: stage 2 was in flight from the weights of stage 1's start, which were not saved" in out
            and "stage 1 after 1 of its updates" in out)
    source._pending = {2: snaps[2]}
    source.close()  # mid-stage weights are not what stage 2 was meant to come from: never saved
    assert not (tmp_path / "stage_002" / "behavior_weights.safetensors").exists()


@pytest.mark.unit
def test_at_a_stages_start_the_stages_of_its_version_come_from_the_policy_and_older_ones_do_not(tmp_path, capsys):
    # k = 2, resumed at stage 3's start: stage 4 was requested at stage 2's start (version 2, lost), stage 5
    # is requested now (version 3: the policy's own weights, exactly).
    source, policy = _source(tmp_path, k=2)
    snaps = source._snapshots(RLState(stage=3, update=6, update_in_stage=0), [4, 5])
    assert snaps[5].version == 3 and snaps[5].at_start
    assert snaps[4].version == 3 and not snaps[4].at_start
    assert "stage 4 was in flight from the weights of stage 2's start" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Runs.


@pytest.fixture(scope="module")
def ahead_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("ahead") / "run"
    r = _train(run_dir, tiny_model_dir, "schedule.async_stages=1")
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_one_stage_ahead_lags_by_at_most_one_stage(ahead_run):
    # Stage t comes from the policy at stage max(0, t - 1)'s start: versions 0, 0, 1, 2.
    assert [set(_versions(ahead_run, t)) for t in range(4)] == [{0}, {0}, {1}, {2}]
    stages = _stages(ahead_run)
    assert [s["stage/policy_lag_max"] for s in stages] == [0, 1, 1, 1]
    assert [s["stage/policy_lag_mean"] for s in stages] == [0.0, 1.0, 1.0, 1.0]
    # The ratio's denominator is the stored behaviour log-probs: at a stage's first update the policy
    # is one stage (2 updates at lr 1e-2) past the one that generated it, not ~0 as at lag 0.
    mismatch = [s["stage/engine_logprob_mismatch"] for s in stages]
    assert mismatch[0] < 1e-4 and min(mismatch[2:]) > 10 * max(mismatch[0], 1e-6)
    assert (ahead_run / "final_model" / "model.safetensors").is_file()


def test_idle_fractions_are_fractions_of_the_measured_stage_interval(ahead_run):
    stages = _stages(ahead_run)
    for s in stages:
        wall = s["perf/stage_wall_s"]
        assert 0 <= s["perf/trainer_idle_frac"] <= 1 and 0 <= s["perf/engine_idle_frac"] <= 1
        assert s["perf/trainer_idle_frac"] == pytest.approx(s["perf/trainer_wait_s"] / wall)
        assert s["perf/engine_idle_frac"] == pytest.approx(s["perf/engine_idle_s"] / wall)
        # The trainer's waits (for data, or for the engine before an evaluation), its updates (in-loop
        # evaluations excluded) and its checkpoints are disjoint parts of the interval, timed on one
        # thread with one clock.
        assert s["perf/trainer_wait_s"] + s["perf/optimize_s"] + s["perf/checkpoint_s"] <= wall
    # The intervals tile the run from the first request for a stage: they sum to at most the last
    # record's time, and each ends before its record is written.
    ends = [sum(s["perf/stage_wall_s"] for s in stages[: i + 1]) for i in range(len(stages))]
    assert all(end <= s["time_s"] for end, s in zip(ends, stages))
    # Stage 0 is generated while the trainer waits: the trainer waits at least the generation's time.
    assert stages[0]["perf/trainer_wait_s"] >= stages[0]["perf/generate_s"]


@pytest.mark.slow  # ~25 s
def test_synchronous_run_is_unchanged_and_records_no_versions(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    r = _train(run_dir, tiny_model_dir, "schedule.num_stages=2", "schedule.total_updates=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0 (synchronous" in r.stdout
    assert all(StageData.load(run_dir / "stages" / f"stage_{t:03d}" / "rollouts_rank0.safetensors").policy_versions
               is None for t in range(2))
    assert not any(k.startswith(("stage/policy_lag", "perf/trainer_idle")) for s in _stages(run_dir) for k in s)


@pytest.mark.slow  # ~20 s; one stage ahead keeps the check
def test_two_stages_ahead_lag_by_at_most_two(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    r = _train(run_dir, tiny_model_dir, "schedule.async_stages=2")
    assert r.returncode == 0, r.stderr[-3000:]
    # versions max(0, t - 2): 0, 0, 0, 1 -> lags 0, 1, 2, 2
    assert [set(_versions(run_dir, t)) for t in range(4)] == [{0}, {0}, {0}, {1}]
    assert [s["stage/policy_lag_max"] for s in _stages(run_dir)] == [0, 1, 2, 2]


@pytest.mark.slow  # ~14 s
def test_replay_with_async_stages_exits_2_naming_both(tmp_path, tiny_model_dir, ahead_run):
    r = _train(tmp_path / "run", tiny_model_dir, "schedule.async_stages=1", "--replay", str(ahead_run))
    assert r.returncode == 2 and "schedule.async_stages=1" in r.stderr and "--replay" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("die_at", [
    # after stage 1's first update (the last checkpoint: stage 1's start, no mid-stage one); stage 2,
    # requested at stage 1's start from those weights, is (most likely) still being generated
    pytest.param("update:3", marks=pytest.mark.slow),  # ~25 s; the stop below resumes in flight too
    pytest.param("generate:2", marks=pytest.mark.slow),  # stage 0's generation: no checkpoint yet
])
def test_kill_during_generation_ahead_resumes_bitwise(tmp_path, tiny_model_dir, ahead_run, die_at):
    run_dir = tmp_path / "run"
    killed = _train(run_dir, tiny_model_dir, "schedule.async_stages=1", MUGRPO_DIE_AT=die_at)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The stages lost in flight are regenerated from the weights that generated them in the
    # uninterrupted run (the checkpoint at a stage's start), so every stage and update is the same.
    ref, got = load_file(str(ahead_run / "final_model" / "model.safetensors")), \
        load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
    assert [set(_versions(run_dir, t)) for t in range(4)] == [{0}, {0}, {1}, {2}]
    updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert [r["update"] for r in updates] == list(range(1, 9))


def _same_final_weights(ref_dir, run_dir):
    ref, got = load_file(str(ref_dir / "final_model" / "model.safetensors")), \
        load_file(str(run_dir / "final_model" / "model.safetensors"))
    return ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)


@pytest.mark.parametrize("stop_at,every", [
    # stage 0, after its first update: the stop writes a mid-stage checkpoint while stage 1 (requested at
    # stage 0's start) is in flight; the resume must generate it from stage 0's start, not from here
    pytest.param("update:1", 0, marks=pytest.mark.slow),
    # stage 1, after its first update, with a checkpoint after every update: stage 2 (from stage 1's start)
    # in flight
    ("update:3", 1),
    pytest.param("generate:2", 0, marks=pytest.mark.slow),   # stage 0's generation: nothing trained yet
    pytest.param("generate:6", 1, marks=pytest.mark.slow),   # stage 1's generation (from stage 0's start)
    pytest.param("generate:10", 0, marks=pytest.mark.slow),  # stage 2's generation (from stage 1's start)
    pytest.param("update:5", 1, marks=pytest.mark.slow),     # stage 2, mid-stage; stage 3 in flight
])
def test_a_stop_during_generation_ahead_resumes_as_printed_to_the_same_weights(tmp_path, tiny_model_dir, ahead_run,
                                                                                stop_at, every):
    run_dir = tmp_path / "run"
    stopped = _train(run_dir, tiny_model_dir, "schedule.async_stages=1", f"checkpoint.every_updates={every}",
                     MUGRPO_STOP_AT=stop_at)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    command = f"mugrpo train --resume {run_dir}"
    assert command in stopped.stderr + stopped.stdout
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", *command.split()[1:]], env=_env(), capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "[mugrpo] resume: stage" not in resumed.stdout  # nothing was generated from other weights
    assert _same_final_weights(ahead_run, run_dir)
    assert [set(_versions(run_dir, t)) for t in range(4)] == [{0}, {0}, {1}, {2}]
    assert [s["stage/policy_lag_max"] for s in _stages(run_dir)] == [0, 1, 1, 1]
    assert not list(run_dir.glob("stages/*/behavior_weights.safetensors"))  # removed once their stages completed


@pytest.mark.slow  # ~25 s
def test_generation_ahead_with_an_environment_and_dynamic_sampling(tmp_path, tiny_model_dir):
    # Both run in the generating thread: multi-turn trajectories (the TryAgain environment, up to 3
    # turns) collected in dynamic sampling's rounds; 3 stages of 2 updates.
    run_dir = tmp_path / "run"
    r = _train(run_dir, tiny_model_dir, "schedule.async_stages=1", "schedule.total_updates=6", "schedule.num_stages=3",
               "task.env=multiturn_envs:TryAgain", "rollout.max_new_tokens=16", "env.max_turns=3",
               "rollout.dynamic_sampling=true", "rollout.prompts_per_stage=16")
    assert r.returncode == 0, r.stderr[-3000:]
    stages = _stages(run_dir)
    assert [s["stage/policy_lag_max"] for s in stages] == [0, 1, 1]
    assert all(s["stage/num_rounds"] >= 1 and "env/num_done" in s for s in stages)
    data = StageData.load(run_dir / "stages" / "stage_002" / "rollouts_rank0.safetensors")
    assert data.turns is not None and set(data.policy_versions) == {1}
