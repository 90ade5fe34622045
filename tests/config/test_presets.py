"""Presets (mugrpo.config.presets): each preset's overrides, and that they are only overrides."""
import pytest

from mugrpo.config.presets import PRESETS
from mugrpo.config.schema import Config

pytestmark = pytest.mark.unit


def test_mu_grpo_is_relaxed_clipping_with_the_suffix_veto_over_four_stale_stages():
    p = PRESETS["mu-grpo"]
    # clip range [1 - 1.0, 1 + 4.0] = [0, 5]
    assert (p["loss.clip_mode"], p["loss.clip_eps_low"], p["loss.clip_eps_high"]) == ("ppo", 1.0, 4.0)
    assert p["loss.veto_scope"] == "suffix"
    assert (p["schedule.num_stages"], p["schedule.updates_per_stage"]) == (4, None)


def test_grpo_is_strict_clipping_without_veto_and_four_updates_per_stage():
    p = PRESETS["grpo"]
    # clip range [1 - 0.2, 1 + 0.2] = [0.8, 1.2]
    assert (p["loss.clip_eps_low"], p["loss.clip_eps_high"], p["loss.veto_scope"]) == (0.2, 0.2, "none")
    assert (p["schedule.updates_per_stage"], p["schedule.num_stages"]) == (4, None)


def test_the_stale_variants():
    stale, relaxed, m2po = PRESETS["grpo-stale"], PRESETS["grpo-stale-relaxed"], PRESETS["m2po"]
    assert (stale["loss.clip_eps_high"], stale["loss.veto_scope"], stale["schedule.num_stages"]) == (0.2, "none", 4)
    # mu-grpo's clip range without its veto
    assert (relaxed["loss.clip_eps_low"], relaxed["loss.clip_eps_high"], relaxed["loss.veto_scope"]) == \
        (1.0, 4.0, "none")
    assert (m2po["loss.clip_mode"], m2po["loss.veto_scope"], m2po["schedule.num_stages"]) == ("m2po", "none", 4)


def test_every_preset_key_is_a_real_config_key_and_the_default_preset_exists():
    cfg = Config()
    assert Config.preset in PRESETS
    for name, overrides in PRESETS.items():
        for key in overrides:
            section, field = key.split(".")
            assert hasattr(getattr(cfg, section), field), f"{name}: {key}"
