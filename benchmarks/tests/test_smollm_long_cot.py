"""The long chain-of-thought benchmark's bookkeeping (benchmarks/smollm/long_cot.py): its configs and
its summaries, on hand-made metrics (no model, no engine)."""

import math

import pytest

from benchmarks.smollm import long_cot
from mugrpo.config import load_config
from mugrpo.config.plan import make_plan

pytestmark = pytest.mark.bench  # a benchmark's bookkeeping: `pytest -m bench benchmarks/tests` runs it


def _config(preset: str):
    cmd = long_cot.command(preset, seed=0, z=long_cot.Sizing(), first=True)
    assert cmd[cmd.index("--preset") + 1] == preset
    return load_config(preset, overrides=cmd[cmd.index("--run-dir") + 2:])


def test_every_preset_gets_the_same_budget_and_data_volume():
    z = long_cot.Sizing()
    plans = {p: make_plan(_config(p)) for p in long_cot.PRESETS}
    assert plans["grpo"].updates_per_stage == 4 and plans["mu-grpo"].updates_per_stage == z.stale_mu >= 64
    for plan in plans.values():
        assert plan.total_updates == z.updates and plan.sequences_per_update == z.prompts_per_update * z.group_size
        assert plan.passes_per_stage == z.passes
        # the same number of generated sequences over the run: stages x sequences per stage
        assert plan.num_stages * plan.sequences_per_stage == z.updates * z.prompts_per_update * z.group_size / z.passes


def test_the_task_prompt_is_a_worked_demonstration_ending_in_a_box():
    cfg = _config("mu-grpo")
    assert cfg.task.params["min_terms"] == long_cot.TASK_PARAMS["min_terms"]
    assert cfg.task.few_shot[0]["answer"].endswith("\\boxed{13}.") and "\nStep 4: Check" in cfg.task.few_shot[0]["answer"]
    assert cfg.task.instruction.endswith("within \\boxed{}.")
    assert cfg.loss.veto_scope == "suffix" and _config("grpo-stale-relaxed").loss.veto_scope == "none"


def test_position_bins_average_by_quarter_of_the_stage():
    # mu = 8 -> quarters of 2 positions; values 0..7 -> means 0.5, 2.5, 4.5, 6.5; a NaN is skipped
    ups = [{"update_in_stage": i, "x": float(i)} for i in range(8)] + [{"update_in_stage": 7, "x": math.nan}]
    assert long_cot.position_bins(ups, "x", mu=8) == [0.5, 2.5, 4.5, 6.5]
    # mu = 4 (grpo): one position per quarter
    assert long_cot.position_bins([{"update_in_stage": 3, "x": 1.0}], "x", mu=4) == [None, None, None, 1.0]


def test_rollout_ratio_is_grpo_seconds_per_token_over_the_stale_runs():
    def run(preset, s_per_tok, sync):
        return {"preset": preset, "seed": 0, "totals": {"s_per_generated_token": s_per_tok, "sync_s_per_refresh": sync,
                                                         "num_stages": 16 if preset == "grpo" else 1,
                                                         "generate_s": 1.0}}

    out = long_cot.rollout_ratio({"grpo/seed0": run("grpo", 0.03, 0.5), "mu-grpo/seed0": run("mu-grpo", 0.01, 0.4)})
    # 0.03 s/token for grpo against 0.01 for the stage: 3x
    assert set(out) == {"mu-grpo/seed0"} and math.isclose(out["mu-grpo/seed0"]["grpo_over_stale"], 3.0)
    assert out["mu-grpo/seed0"]["grpo_num_refreshes"] == 16
