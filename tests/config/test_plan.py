import pytest

from mugrpo.config import ConfigError, load_config
from mugrpo.config.plan import make_plan

pytestmark = pytest.mark.unit


def test_mu_grpo_default_plan():
    # 32 updates / 4 stages = mu 8; 8 prompts/update x 8 updates = 64 prompts/stage (one pass);
    # 8 prompts x G 8 = 64 sequences/update, micro-batches cut by a 1024-token budget; staleness 0..7.
    p = make_plan(load_config("mu-grpo"))
    assert (p.num_stages, p.updates_per_stage, p.prompts_per_stage) == (4, 8, 64)
    assert (p.sequences_per_update, p.micro_batch_tokens, p.micro_batch_size, p.max_staleness) == (64, 1024, None, 7)
    assert p.passes_per_stage == 1.0 and p.weight_syncs == 4


def test_grpo_refreshes_every_four_updates():
    p = make_plan(load_config("grpo", overrides=["schedule.total_updates=64"]))
    assert (p.num_stages, p.updates_per_stage, p.max_staleness) == (16, 4, 3)


def test_passes_over_stage_data_are_derived():
    # mu 8 x 8 prompts = 64 prompt draws over a 16-prompt stage -> 4 passes.
    p = make_plan(load_config("mu-grpo", overrides=["rollout.prompts_per_stage=16"]))
    assert p.passes_per_stage == 4.0 and p.sequences_per_stage == 128


def test_world_size_splits_sequences():
    # 64 sequences / 2 ranks = 32 per rank.
    p = make_plan(load_config("mu-grpo"), world_size=2)
    assert p.sequences_per_update_per_rank == 32


@pytest.mark.parametrize("overrides,needle", [
    (["schedule.total_updates=30"], "not a multiple of schedule.num_stages"),
    (["schedule.updates_per_stage=16"], "set one of them to null"),
    (["schedule.micro_batch_tokens=0"], "micro_batch_tokens"),
    (["schedule.micro_batch_size=0"], "micro_batch_size"),
    (["rollout.prompts_per_stage=4"], "exceeds rollout.prompts_per_stage"),
    (["schedule.num_stages=null"], "both null"),
])
def test_impossible_plans_are_refused(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("mu-grpo", overrides=overrides)


def test_ranks_must_divide_prompt_groups():
    cfg = load_config("mu-grpo", overrides=["schedule.prompts_per_update=3"])
    with pytest.raises(ConfigError, match="divisible by the number of ranks"):
        make_plan(cfg, world_size=2)
