"""mugrpo.warmstart.guard: when a warm start must stop instead of exporting (warmstart.lr=1e9
exported weights around 1e9 after 2 of 3 steps were skipped), and its line per step."""
import math

import pytest

from mugrpo.kit.model_parts import TrainingError
from mugrpo.warmstart.guard import check_step, divergence_threshold, step_line


@pytest.mark.unit
def test_divergence_threshold_is_twice_a_uniform_guess():
    assert divergence_threshold(100) == pytest.approx(2 * 4.605170186, rel=1e-9)  # 2 ln 100 by hand
    assert divergence_threshold(49152) == pytest.approx(21.605, abs=1e-3)        # SmolLM2's vocabulary


@pytest.mark.unit
@pytest.mark.parametrize("step, skipped, stops", [
    (1, 1, False),   # a lone first skip: too early to judge
    (2, 2, False),   # the "mostly skipped" rule starts at step 3 (all skipped: the end's own check)
    (3, 1, False),   # 1 of 3
    (3, 2, True),    # 2 of 3: the lr=1e9 warm start
    (4, 2, False),   # exactly half is not "mostly"
    (5, 3, True),
])
def test_mostly_skipped_steps_stop_the_warm_start(step, skipped, stops):
    call = lambda: check_step(step, 10, float("nan"), skipped, 100, 1e9)  # noqa: E731
    if stops:
        message = f"{skipped} of its {step} steps were skipped.*warmstart.lr \\(now 1e\\+09\\)"
        with pytest.raises(TrainingError, match=message):
            call()
    else:
        call()


@pytest.mark.unit
def test_a_finite_loss_above_twice_a_uniform_guess_is_divergence():
    limit = 2 * math.log(100)  # 9.21
    check_step(1, 10, 9.2, 0, 100, 1e-5)  # below: a bad start, not a divergence
    with pytest.raises(TrainingError, match=r"step 2 of 10: its loss diverged \(mean NLL 9\.3 per token, above "
                                            r"2 ln V = 9\.21.*100-token.*warmstart.lr \(now 0\.5\)"):
        check_step(2, 10, 9.3, 0, 100, 0.5)


@pytest.mark.unit
def test_step_line():
    m = {"sft/loss": 1.23456, "sft/num_tokens": 12.0, "optim/skipped": 0.0}
    assert step_line(3, 12, m, 0.814) == "[mugrpo] warm start step 3/12: loss 1.2346, 12 tokens, 0.81 s"
    m = {"sft/loss": float("nan"), "sft/num_tokens": 12.0, "optim/skipped": 1.0}
    assert step_line(4, 12, m, 2.0).endswith("loss nan, 12 tokens, 2.00 s (skipped: non-finite)")
