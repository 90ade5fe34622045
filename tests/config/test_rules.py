"""Rules that span config sections (mugrpo.config.rules): refusals naming both keys, the stage
arithmetic, and the resume-safe listing."""
import warnings

import pytest

from mugrpo.config.rules import resume_safe_keys, stage_shape, validate
from mugrpo.config.schema import Config, RolloutConfig, ScheduleConfig
from mugrpo.errors import ConfigError

pytestmark = pytest.mark.unit


def test_async_stages_with_trainer_logprobs_is_refused_naming_both_keys():
    cfg = Config()
    cfg.schedule.async_stages, cfg.loss.behavior_logprobs = 1, "trainer"
    with pytest.raises(ConfigError, match=r"schedule.async_stages=1 and loss.behavior_logprobs=trainer do not combine"):
        validate(cfg)


def test_async_stages_with_lora_dropout_is_refused_unless_the_engine_is_remote():
    cfg = Config()
    cfg.schedule.async_stages, cfg.lora.rank, cfg.lora.dropout = 1, 8, 0.1
    for engine in ("auto", "hf", "vllm"):
        cfg.rollout.engine = engine
        with pytest.raises(ConfigError, match=rf"schedule.async_stages=1 and lora.dropout=0.1 do not combine.*"
                                              rf"rollout.engine={engine}.*Set lora.dropout=0"):
            validate(cfg)
    cfg.rollout.engine, cfg.rollout.remote.urls = "remote", ["http://127.0.0.1:8100"]
    validate(cfg)  # the engine samples in another process
    cfg.rollout.engine, cfg.lora.dropout = "hf", 0.0
    validate(cfg)


def test_two_ways_of_checkpointing_activations_are_refused():
    cfg = Config()
    cfg.parallel.activation_checkpointing, cfg.model.gradient_checkpointing = True, True
    with pytest.raises(ConfigError, match=r"set model.gradient_checkpointing=false"):
        validate(cfg)


def test_validate_runs_each_sections_own_check():
    cfg = Config()
    cfg.optim.lr = 0.0
    with pytest.raises(ConfigError, match=r"optim.lr=0.0 is out of range"):
        validate(cfg)


def test_stage_shape_by_hand():
    r = RolloutConfig()
    # U = 32 over K = 4 stages: mu = 8; prompts per stage = 8 x 8 prompts per update = 64
    assert stage_shape(ScheduleConfig(total_updates=32, num_stages=4, prompts_per_update=8), r) == (8, 4, 64)
    # mu = 4 given: K = 12 / 4 = 3; 4 x 2 = 8 prompts per stage
    s = ScheduleConfig(total_updates=12, updates_per_stage=4, num_stages=None, prompts_per_update=2)
    assert stage_shape(s, r) == (4, 3, 8)
    # both given and disagreeing: 3 x 5 = 15 != 16
    with pytest.raises(ConfigError, match=r"schedule.num_stages=3 x schedule.updates_per_stage=5 = 15 updates, "
                                          r"but schedule.total_updates=16"):
        stage_shape(ScheduleConfig(total_updates=16, num_stages=3, updates_per_stage=5), r)
    # adaptive: min updates 5 > mu = 16 / 4 = 4
    with pytest.raises(ConfigError, match=r"schedule.adaptive_min_updates=5 exceeds the maximum stage length mu=4"):
        stage_shape(ScheduleConfig(total_updates=16, adaptive="kl", adaptive_min_updates=5), r)


def test_a_warmup_longer_than_the_run_warns():
    cfg = Config()
    cfg.optim.warmup_updates = 40  # > schedule.total_updates = 32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(cfg)
    assert any("optim.warmup_updates=40 exceeds schedule.total_updates=32" in str(w.message) for w in caught)


def test_resume_safe_keys_list_safe_fields_and_whole_sections():
    keys = resume_safe_keys()
    assert "train.threads" in keys and "warmstart.checkpoint_every" in keys
    assert "eval." in keys and "log." in keys  # a whole section marked safe ends in '.'
    assert "optim.lr" not in keys and "loss.veto_delta" not in keys  # these change the experiment
    # a section's own keys, with its prefix
    assert resume_safe_keys(ScheduleConfig) == ()
