"""Training with an environment (multi-turn trajectories) through every preset and the features
that touch the update: LoRA, TIS (trainer-side behaviour log-probs), adaptive stages. Tiny model,
a scripted environment (tests/multiturn_envs.py); the zero-advantage skip and the shared-prefix
layout are on by default, and tests/kit/test_update_multiturn.py checks them against the plain path."""
import json

import pytest
from conftest import TINY_OVERRIDES

from mugrpo.cli import main

from mugrpo.config import load_config
from mugrpo.observability.loggers import read_metrics
from mugrpo.stages.data import StageData
from mugrpo.pipeline import train

ENV = ["task.env=multiturn_envs:TryAgain", "rollout.max_new_tokens=16", "env.max_turns=3"]
ENDS = ("done", "turn_limit", "length", "overflow", "env_error", "env_timeout", "env_bad_output")


def _train(tmp_path, model_dir, preset, *extra, updates=4, evals=None):
    cfg = load_config(preset, overrides=[f"model.name={model_dir}", *TINY_OVERRIDES, *ENV, "eval.num_items=8",
                                         f"schedule.total_updates={updates}", "optim.lr=1e-2", *extra])
    run_dir = tmp_path / "run"
    train(cfg, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if evals is not None:
        evals += [r for r in records if r["kind"] == "eval"]
    return run_dir, [r for r in records if r["kind"] == "update"], [r for r in records if r["kind"] == "stage"]


def _check_multi_turn_stage(run_dir, stage):
    data = StageData.load(run_dir / "stages" / f"stage_{stage:03d}" / "rollouts_rank0.safetensors")
    assert data.turns is not None and any(k < 0 for t in data.turns for k in t)  # env tokens stored
    assert any(max(t) >= 1 for t in data.turns)  # and trajectories of more than one policy turn


@pytest.mark.parametrize("preset", [pytest.param("grpo", marks=pytest.mark.slow),
                                    pytest.param("grpo-stale", marks=pytest.mark.slow), pytest.param("grpo-stale-relaxed", marks=pytest.mark.slow),
                                    pytest.param("m2po", marks=pytest.mark.slow), "mu-grpo"])
def test_every_preset_trains_on_multi_turn_trajectories(tmp_path, tiny_model_dir, preset):
    run_dir, updates, stages = _train(tmp_path, tiny_model_dir, preset)
    assert len(updates) == 4 and stages
    for s in stages:
        # Every trajectory ended in one of the loop's ways, counted.
        ends = sum(s[f"env/num_{r}"] for r in ENDS)
        assert ends == s["stage/num_sequences"] and s["env/num_env_tokens"] > 0
        assert s["stage/policy_len_mean"] < s["stage/response_len_mean"]
    assert all("loss/veto_token_frac_turn2" in u and "loss/first_trigger_turn" in u for u in updates)
    _check_multi_turn_stage(run_dir, 0)
    assert (run_dir / "final_model").is_dir()


def test_reward_rises_with_an_environment_and_evaluation_runs_through_it(tmp_path, tiny_model_dir, capsys):
    # TryAgain rewards 0.1 per '1' in the final turn (+ the task's frac_ones on it); the random
    # initial policy writes '1' about 1 time in 100. Measured: 0.004 -> 1.03 over 4 stages.
    evals = []
    run_dir, _, stages = _train(tmp_path, tiny_model_dir, "mu-grpo", updates=16, evals=evals)
    assert stages[-1]["reward/mean"] > stages[0]["reward/mean"] + 0.3
    # Held-out evaluation runs the same environment: 8 items x 1 greedy trajectory, each counted once.
    assert evals and all(sum(e[f"eval/env/num_{r}"] for r in ENDS) == 8 for e in evals)
    assert evals[-1]["eval/greedy_acc"] > evals[0]["eval/greedy_acc"]  # frac_ones of the final turn
    # mugrpo eval on the run: the saved config's environment, its counts in the results.
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(run_dir), "--task", "train", "--num-items", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    result, n = report["tasks"]["train"], int(report["settings"]["greedy"]) + report["settings"]["n"]
    assert sum(result[f"env/num_{r}"] for r in ENDS) == 4 * n and result["env/num_env_tokens"] > 0


@pytest.mark.parametrize("extra, check", [
    pytest.param(["lora.rank=4", "lora.target_modules=[q_proj,v_proj]"], "lora", marks=pytest.mark.slow),
    pytest.param(["loss.behavior_logprobs=trainer"], "tis", marks=pytest.mark.slow),
    pytest.param(["schedule.adaptive=kl", "schedule.adaptive_kl_max=1e-12", "schedule.adaptive_min_updates=1",
                  "schedule.num_stages=1"], "adaptive", marks=pytest.mark.slow),
])
def test_lora_tis_and_adaptive_stages_with_an_environment(tmp_path, tiny_model_dir, extra, check):
    run_dir, updates, stages = _train(tmp_path, tiny_model_dir, "mu-grpo", *extra)
    assert len(updates) == 4
    _check_multi_turn_stage(run_dir, 0)
    if check == "tis":
        # The trainer's recompute of the behaviour log-probs (fp32, same weights) equals the engine's on
        # policy tokens: the first update sees ratio 1 (single-turn tests' tolerance).
        assert stages[0]["stage/engine_trainer_log_ratio_abs_mean"] < 1e-5
    if check == "adaptive":
        # A guard that always trips (from the 2nd update on: the first never does): stages of 2, not 4.
        assert (stages[0]["stage/end_reason"], stages[0]["stage/num_updates"]) == ("kl", 2)
