"""What a warm start says about each step, and when it must stop instead of exporting a broken model.

RL stops after ``checkpoint.max_bad_updates`` non-finite updates in a row
(:func:`mugrpo.kit.step.step_optimizer`, shared with the warm start). A warm start can be
broken without such a streak: at ``warmstart.lr=1e9`` one step blows the weights up, the next is
non-finite and skipped, the one after is finite again, and the run would export weights around 1e9.
:func:`check_step` stops it (:class:`~mugrpo.kit.model_parts.TrainingError`, exit 2, no model
written) on either sign:

- **mostly skipped**: from the third step on, more than half of the steps so far were skipped as
  non-finite (a single skip early on is tolerated, as in RL);
- **diverged**: a step's mean NLL above ``2 ln V`` (V = the tokenizer's vocabulary): twice the loss
  of a uniform guess over every token, which no model still learning its demonstrations reaches.

:func:`step_line` is the line printed per step when progress bars are off (``train.progress=false``).
"""

from __future__ import annotations

import math

from mugrpo.kit.model_parts import TrainingError

MIN_STEPS_FOR_SKIP_RULE = 3
"""The "mostly skipped" rule applies from this step on (a lone early skip is not a broken run)."""


def divergence_threshold(vocab_size: int) -> float:
    """``2 ln V``: twice the mean NLL of a uniform guess over ``vocab_size`` tokens."""
    return 2.0 * math.log(max(vocab_size, 2))


def check_step(step: int, total: int, loss: float, num_skipped: int, vocab_size: int, lr: float) -> None:
    """Raise TrainingError when the warm start is broken after step ``step`` (1-based) of ``total``:
    more than half of its steps skipped (from step 3), or this step's finite ``loss`` above
    :func:`divergence_threshold`. ``lr``: named in the advice."""
    if step >= MIN_STEPS_FOR_SKIP_RULE and 2 * num_skipped > step:
        raise TrainingError(f"warm start stopped at step {step} of {total}: {num_skipped} of its {step} steps were "
                            f"skipped for a non-finite loss or gradient, so it is not learning. No model was "
                            f"written. Lower warmstart.lr (now {lr:g}) or set train.autocast=none, and run the command "
                            "again")
    limit = divergence_threshold(vocab_size)
    if math.isfinite(loss) and loss > limit:
        raise TrainingError(f"warm start stopped at step {step} of {total}: its loss diverged (mean NLL {loss:.4g} "
                            f"per token, above 2 ln V = {limit:.2f}, twice a uniform guess over the {vocab_size}-token "
                            f"vocabulary). No model was written. Lower warmstart.lr (now {lr:g}) and run the command "
                            "again")


def step_line(step: int, total: int, metrics: dict, seconds: float) -> str:
    """``[mugrpo] warm start step 3/12: loss 1.2345, 0.81 s`` (and ``skipped`` for a skipped step)."""
    skipped = " (skipped: non-finite)" if metrics.get("optim/skipped") else ""
    return (f"[mugrpo] warm start step {step}/{total}: loss {metrics['sft/loss']:.4f}, "
            f"{int(metrics['sft/num_tokens'])} tokens, {seconds:.2f} s{skipped}")
