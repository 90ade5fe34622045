"""Dynamic sampling in the whole loop, on the tiny model: it keeps exactly informative groups, one
round without over-generation is bitwise today's run, a kill between (or inside) rounds resumes
bitwise, a stage with nothing informative goes on, it works with grpo refreshes and adaptive stages,
bad values stop at start, and with an environment it keeps informative trajectory groups and
resumes bitwise between rounds."""
import subprocess
import sys

import pytest
from conftest import TINY_OVERRIDES
from safetensors.torch import load_file
from kit.test_resume import _env

from mugrpo.algo.advantages import zero_variance_groups
from mugrpo.config import ConfigError, load_config
from mugrpo.config.plan import format_plan, make_plan
from mugrpo.observability.loggers import read_metrics
from mugrpo.stages.data import StageData
from mugrpo.pipeline import train

SPARSE = ["task.reward_fn=sparse_rewards:has_one", "rollout.group_size=4"]
"""A binary reward the random tiny model earns about 1 time in 10: most groups of 4 are all zero."""
ON = ["rollout.dynamic_sampling=true", "rollout.dynamic_oversample=2", "rollout.dynamic_max_rounds=4"]


def _overrides(model_dir, *extra):
    return [f"model.name={model_dir}", *TINY_OVERRIDES, *SPARSE, "schedule.total_updates=8", "schedule.num_stages=2",
            "optim.lr=1e-2", "train.deterministic=true", "train.threads=1", *extra]


def _train(tmp_path, model_dir, name, *extra, preset="mu-grpo"):
    run_dir = tmp_path / name
    train(load_config(preset, overrides=_overrides(model_dir, *extra)), run_dir)
    return run_dir


def _stages(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"]


def _params(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def test_dynamic_sampling_keeps_exactly_informative_groups(tmp_path, tiny_model_dir):
    off = _train(tmp_path, tiny_model_dir, "off")
    on = _train(tmp_path, tiny_model_dir, "on", *ON)
    # Without it, most groups of stage 0 are all zero (the premise of the test).
    assert _stages(off)[0]["stage/zero_var_group_frac"] > 0.5
    for stage, record in enumerate(_stages(on)):
        data = StageData.load(on / "stages" / f"stage_{stage:03d}" / "rollouts_rank0.safetensors")
        informative = ~zero_variance_groups(data.rewards.view(-1, 4))
        # 32 groups needed per stage (4 updates x 8 prompts); every one kept is informative.
        assert data.num_groups == record["stage/num_groups_needed"] == 32
        assert bool(informative.all()), stage
        assert record["stage/num_informative_groups"] >= 32 and record["stage/zero_var_group_frac"] == 0.0
        generated = record["stage/num_informative_groups"] / record["stage/informative_frac"]
        assert record["stage/num_extra_sequences"] == round(generated - 32) * 4
        assert 1 <= record["stage/num_rounds"] <= 4 and record["perf/extra_generate_s"] > 0
        assert not (on / "stages" / f"stage_{stage:03d}" / "rounds").exists()  # removed once the stage is saved
    # Round 0 drew 2 x 32 = 64 prompts and found too few: stage 0 needed more rounds.
    assert _stages(on)[0]["stage/num_rounds"] >= 2
    # The behaviour policy's reward over every generated sequence, not the kept groups' (biased up).
    assert _stages(on)[0]["reward/mean"] < _stages(on)[0]["stage/kept_reward_mean"]


def test_one_round_without_oversampling_is_bitwise_todays_run(tmp_path, tiny_model_dir):
    # Round 0 draws the stage's usual prompts with the usual sampling seed and keeps every group
    # (filling with the uninformative ones, in draw order): the same data, so the same run.
    off = _train(tmp_path, tiny_model_dir, "off")
    one = _train(tmp_path, tiny_model_dir, "one", "rollout.dynamic_sampling=true", "rollout.dynamic_oversample=1",
                 "rollout.dynamic_max_rounds=1")
    ref, got = _params(off), _params(one)
    assert all(ref[k].equal(got[k]) for k in ref)
    assert [r["reward/mean"] for r in _stages(off)] == [r["reward/mean"] for r in _stages(one)]


def test_no_informative_group_says_so_and_goes_on(tmp_path, tiny_model_dir, capsys):
    # The reward is 0 for every response: nothing is ever informative.
    run = _train(tmp_path, tiny_model_dir, "none", *ON, "task.reward_fn=sparse_rewards:never")
    out = capsys.readouterr().out
    assert "dynamic sampling found no informative group" in out
    stages = _stages(run)
    assert len(stages) == 2
    for record in stages:
        assert record["stage/num_informative_groups"] == 0 and record["stage/informative_frac"] == 0.0
        assert record["stage/num_rounds"] == 4                       # every round was tried
        assert record["stage/num_extra_sequences"] == (4 * 64 - 32) * 4  # 4 rounds of 2 x 32 prompts, 32 kept
    assert (run / "final_model").is_dir()


@pytest.mark.parametrize("preset,extra", [
    ("grpo", []),                                              # refreshes every 4 updates
    ("mu-grpo", ["schedule.adaptive=kl", "schedule.adaptive_kl_max=1e-9", "schedule.adaptive_min_updates=1"]),
])
def test_works_with_grpo_refreshes_and_adaptive_stages(tmp_path, tiny_model_dir, preset, extra):
    run = _train(tmp_path, tiny_model_dir, preset, *ON, *extra, "schedule.num_stages=null",
                 "schedule.updates_per_stage=4", preset=preset)
    stages = _stages(run)
    updates = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "update"]
    assert len(updates) == 8
    for record in stages:
        data = StageData.load(run / "stages" / f"stage_{record['stage']:03d}" / "rollouts_rank0.safetensors")
        assert bool((~zero_variance_groups(data.rewards.view(-1, 4))).all())
    if extra:  # a guard at KL 1e-9 trips once the policy moved: short stages, each generated in rounds
        assert len(stages) > 2 and all(r["stage/num_updates"] < 4 for r in stages)
    # Each stage was generated for the longest it could run: min(mu = 4, the updates left of the
    # budget of 8) updates of 8 prompts; so an adaptive stage starting at update 6 needs 2 x 8 = 16
    # groups, not 32, and keeps exactly that many.
    first = 0
    for record in stages:
        data = StageData.load(run / "stages" / f"stage_{record['stage']:03d}" / "rollouts_rank0.safetensors")
        assert record["stage/num_groups_needed"] == data.num_groups == 8 * min(4, 8 - first), record
        first += record["stage/num_updates"]
    assert first == 8


def _cmd(run_dir, model_dir, *extra):
    return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), *_overrides(model_dir, *ON, *extra),
            "checkpoint.every_updates=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("dyn_ref") / "run"
    r = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("die_at", [
    pytest.param("round:1", marks=pytest.mark.slow),  # stage 0, after its first round is persisted
    pytest.param("round:2", marks=pytest.mark.slow),  # stage 0, between its second and third round
    pytest.param("update:3", marks=pytest.mark.slow),  # mid-stage 0 (checkpoint at update 2): the stage line's dynamic metrics are read back
    # round 1's first batch (round 0: 64 prompts x 4 = 4 batches of 64): round 1 is generated again, round 0
    # read back
    pytest.param("generate:5", marks=pytest.mark.slow),
])
def test_killed_between_rounds_resumes_bitwise(tmp_path, tiny_model_dir, reference, die_at):
    run_dir = tmp_path / "run"
    killed = subprocess.run(_cmd(run_dir, tiny_model_dir), env=_env(die_at), capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run_dir / "stages" / "stage_000" / "rounds").is_dir() != die_at.startswith("update")
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _params(reference), _params(run_dir)
    assert all(ref[k].equal(got[k]) for k in ref)
    keys = ("stage/num_rounds", "stage/informative_frac", "stage/num_extra_sequences", "stage/num_informative_groups",
            "stage/kept_reward_mean", "reward/mean", "reward/std", "stage/num_groups_trained")
    assert [[r[k] for k in keys] for r in _stages(run_dir)] == [[r[k] for k in keys] for r in _stages(reference)]


@pytest.mark.parametrize("key,value", [("rollout.dynamic_max_rounds", 0), ("rollout.dynamic_oversample", 0.5)])
def test_bad_values_stop_at_start(tiny_model_dir, tmp_path, key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("mu-grpo", overrides=["rollout.dynamic_sampling=true", f"{key}={value}"])
    r = subprocess.run(_cmd(tmp_path / "run", tiny_model_dir, f"{key}={value}"), env=_env(), capture_output=True,
                       text=True)
    assert r.returncode == 2 and key in r.stderr and not (tmp_path / "run").exists()


def test_plan_shows_it():
    cfg = load_config("mu-grpo", overrides=ON + ["schedule.total_updates=32", "schedule.prompts_per_update=8"])
    text = format_plan(make_plan(cfg), cfg)
    # mu = 32 / 4 stages = 8 updates x 8 prompts = 64 groups needed; round 0 = 2 x 64 = 128 prompts x G 8.
    rows = {line[:30].strip(): line[30:].strip() for line in text.splitlines()}
    assert rows["informative groups needed"] == "64 per stage"
    assert rows["round 0 draws"] == "128 prompts (2 x 64), 1024 sequences"
    off = load_config("mu-grpo")
    off_rows = {line[:30].strip(): line[30:].strip() for line in format_plan(make_plan(off), off).splitlines()}
    assert off_rows["dynamic sampling"] == "off" and "round 0 draws" not in off_rows


@pytest.mark.slow  # ~45 s; the single-turn rounds above keep the default tier's check
def test_dynamic_sampling_with_an_environment_keeps_informative_trajectory_groups(tmp_path, tiny_model_dir):
    """A multi-turn stage generated in rounds: every kept group of trajectories is informative, the
    turns are kept with the data, and the environment's counts cover every trajectory of every round."""
    from mugrpo.rollout.multiturn import END_REASONS

    run = _train(tmp_path, tiny_model_dir, "env", *ON, "rollout.dynamic_oversample=1", "task.env=multiturn_envs:TryAgain",
                 "rollout.max_new_tokens=12", "task.reward_fn=sparse_rewards:never")
    for record in _stages(run):
        data = StageData.load(run / "stages" / f"stage_{record['stage']:03d}" / "rollouts_rank0.safetensors")
        assert data.turns is not None and any(k > 0 for t in data.turns for k in t)  # several policy turns kept
        informative = ~zero_variance_groups(data.rewards.view(-1, 4))
        found = record["stage/num_informative_groups"]
        assert int(informative.sum()) == min(found, 32) and data.num_groups == 32  # short: filled up
        generated = sum(record[f"env/num_{reason}"] for reason in END_REASONS)
        assert generated == record["stage/num_sequences"] + record["stage/num_extra_sequences"] > 32 * 4
    assert sum(r["stage/num_rounds"] for r in _stages(run)) > 2  # the premise: more than one round was needed

@pytest.mark.slow  # ~35 s; the single-turn kills between rounds are kept
def test_an_environment_stage_killed_between_rounds_resumes_bitwise(tmp_path, tiny_model_dir):
    env_on = ["rollout.dynamic_oversample=1", "task.env=multiturn_envs:TryAgain", "rollout.max_new_tokens=12",
              "task.reward_fn=sparse_rewards:never"]
    runs = {}
    for name, die_at in (("reference", None), ("killed", "round:1")):
        runs[name] = tmp_path / name
        r = subprocess.run(_cmd(runs[name], tiny_model_dir, *env_on), env=_env(die_at), capture_output=True, text=True)
        assert r.returncode == (-9 if die_at else 0), r.stderr[-3000:]
    assert (runs["killed"] / "stages" / "stage_000" / "rounds").is_dir()  # died with round 0 on disk
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(runs["killed"])], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _params(runs["reference"]), _params(runs["killed"])
    assert all(ref[k].equal(got[k]) for k in ref)
    keys = ("stage/num_rounds", "stage/num_extra_sequences", "env/num_done", "env/num_turn_limit", "env/turns_mean")
    assert [[r[k] for k in keys] for r in _stages(runs["killed"])] == [[r[k] for k in keys]
                                                                       for r in _stages(runs["reference"])]
