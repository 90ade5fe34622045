"""mugrpo.config.plan: the presets' staleness at the run's budget.
grpo fixes mu = 4 updates per stage; the stale presets (mu-grpo, m2po, ...) fix K = 4 stages, mu = U / 4.
By hand: U = 8: grpo mu 4, mu-grpo mu 2 (inverted); U = 16: both mu 4 (identical); U = 32: mu-grpo mu 8
(the intended order). The smallest budget that restores the order is U = 20 (mu-grpo mu 5 > 4: U must
be a multiple of 4 for both)."""
import pytest

from mugrpo.config import load_config
from mugrpo.config.plan import format_plan, make_plan, preset_staleness, staleness_note


def _cfg(preset, *overrides):
    return load_config(preset, None, list(overrides))


@pytest.mark.unit
@pytest.mark.parametrize("total, grpo_mu, stale_mu", [(8, 4, 2), (16, 4, 4), (32, 4, 8)])
def test_each_presets_mu_at_the_budget(total, grpo_mu, stale_mu):
    table = preset_staleness(_cfg("mu-grpo", f"schedule.total_updates={total}"))
    assert table["grpo"] == ("fixed_mu", grpo_mu)
    assert table["mu-grpo"] == table["m2po"] == table["grpo-stale"] == ("fixed_stages", stale_mu)


@pytest.mark.unit
def test_at_8_updates_mu_grpo_is_the_fresher_and_the_note_says_how_to_restore_the_order():
    note = staleness_note(_cfg("mu-grpo", "schedule.total_updates=8"))
    assert note.startswith("at schedule.total_updates=8, mu-grpo has mu=2 updates per stage (staleness 0 .. 1) and "
                           "grpo mu=4 (0 .. 3): the stale presets are the fresher")
    # 20: the first budget where U / 4 > 4; num_stages=1: 8 updates in one stage (2 stages: mu 4, not > 4)
    assert note.endswith("schedule.total_updates=20 or schedule.num_stages=1 on the stale presets' runs (mu=8)")
    from_grpo = staleness_note(_cfg("grpo", "schedule.total_updates=8"))
    assert "grpo has mu=4" in from_grpo and "grpo-stale, grpo-stale-relaxed, m2po, mu-grpo mu=2" in from_grpo


@pytest.mark.unit
def test_at_16_updates_the_schedules_are_identical():
    note = staleness_note(_cfg("mu-grpo", "schedule.total_updates=16"))
    assert "mu-grpo and grpo have the same schedule (mu=4 updates per stage, staleness 0 .. 3)" in note
    assert note.endswith("schedule.num_stages=2 on the stale presets' runs (mu=8)")  # 16 / 2 = 8 > 4


@pytest.mark.unit
def test_at_32_updates_the_order_holds_and_nothing_is_said():
    for preset in ("mu-grpo", "grpo", "m2po"):
        cfg = _cfg(preset, "schedule.total_updates=32")
        assert staleness_note(cfg) is None and "note:" not in format_plan(make_plan(cfg), cfg)


@pytest.mark.unit
def test_a_schedule_the_user_set_is_not_compared():
    # the user's own num_stages overrides the preset's: every preset would run this same schedule
    assert staleness_note(_cfg("mu-grpo", "schedule.total_updates=8", "schedule.num_stages=1")) is None
    assert staleness_note(_cfg("mu-grpo", "schedule.total_updates=8", "schedule.adaptive=kl")) is None


@pytest.mark.unit
def test_the_plan_table_ends_with_the_note():
    cfg = _cfg("mu-grpo", "schedule.total_updates=8")
    assert format_plan(make_plan(cfg), cfg).splitlines()[-1] == f"note: {staleness_note(cfg)}"
