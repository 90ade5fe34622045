"""The config schema (mugrpo.config.schema): each section refuses a bad value naming its key; the
defaults pass."""
import pytest

from mugrpo.config.schema import (MAX_ASYNC_STAGES, CheckpointConfig, Config, EvalConfig, LoraConfig, LossConfig,
                                  OptimConfig, ScheduleConfig)
from mugrpo.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("section, needle", [
    (ScheduleConfig(total_updates=0), "schedule.total_updates=0 is out of range; accepted: an integer >= 1"),
    (ScheduleConfig(async_stages=MAX_ASYNC_STAGES + 1), f"schedule.async_stages={MAX_ASYNC_STAGES + 1} is out of range"),
    (ScheduleConfig(updates_per_stage=None, num_stages=None), "schedule.updates_per_stage and schedule.num_stages "
                                                              "are both null"),
    (LossConfig(clip_eps_low=1.5), "loss.clip_eps_low=1.5 is out of range"),
    (LossConfig(clip_mode="nope"), "loss.clip_mode='nope' is not a known option"),
    (LossConfig(tis_cap=0.0), "loss.tis_cap=0.0 is out of range"),
    (OptimConfig(lr=float("inf")), "optim.lr=inf is out of range; accepted: a finite number > 0"),
    (LoraConfig(dropout=1.0), "lora.dropout=1.0 is out of range; accepted: in [0, 1)"),
    (CheckpointConfig(keep_last=0), "checkpoint.keep_last=0 is out of range"),
    (EvalConfig(num_items=-1), "eval.num_items=-1 is out of range"),
])
def test_a_bad_value_names_its_key(section, needle):
    with pytest.raises(ConfigError) as info:
        section.validate()
    assert needle in str(info.value)


def test_a_correction_that_needs_trainer_logprobs_says_which_setting():
    with pytest.raises(ConfigError, match=r"loss.correction=icepop .* set loss.behavior_logprobs=trainer"):
        LossConfig(correction="icepop").validate()
    LossConfig(correction="icepop", behavior_logprobs="trainer").validate()


def test_the_defaults_pass_every_section():
    cfg = Config()
    for section in (cfg.schedule, cfg.loss, cfg.optim, cfg.train, cfg.parallel, cfg.lora, cfg.checkpoint,
                    cfg.eval, cfg.log):
        section.validate()


def test_describe_the_clip_range():
    # [1 - 1.0, 1 + 4.0] = [0, 5]; [1 - 0.2, 1 + 0.2] = [0.8, 1.2]
    assert LossConfig().describe() == "[0, 5]"
    assert LossConfig(clip_eps_low=0.2, clip_eps_high=0.2).describe() == "[0.8, 1.2]"
    assert LossConfig(clip_mode="m2po").describe() == "M2PO (second-moment budget 0.04)"
    assert LossConfig(ratio_level="sequence").describe() == "[0, 5] on the sequence-level ratio (GSPO)"
