"""RL's run state: the position of a staged run, on top of what every phase's resume holds.

:class:`RLState` extends :class:`mugrpo.kit.checkpoint.RunState` (the global update, the non-finite
step counts, the clock) with the stage: which stage, how many of its updates are done, the stage's first
log-ratio, and a stage-end evaluation a stop abandoned. A checkpoint stores these fields with the rest
(``trainer_state.json``), and its folder name carries the stage position.

:func:`kept_after_resume` is RL's rule for the metric records a resumed run keeps (the lifecycle
applies it: :func:`mugrpo.kit.lifecycle.truncate_metrics`). Not here: the loop that moves the position
(:mod:`mugrpo.training.trainer`), what a stage's data is (:mod:`mugrpo.stages.data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mugrpo.evaluation.schedule import evaluates_at_start
from mugrpo.kit.checkpoint import RunState


@dataclass
class RLState(RunState):
    """A staged RL run's position (the fields a resume needs beyond :class:`RunState`'s)."""

    stage: int = 0
    update_in_stage: int = 0
    """Updates already done in ``stage`` (0 = the stage's data may not exist yet)."""
    stage_first_log_ratio: float | None = None
    """The stage's first update's ``loss/log_ratio_abs_mean`` (its ``stage/engine_logprob_mismatch``),
    kept so that a resume past that update still logs it; None before the stage's first update."""
    eval_pending: bool = False
    """A stop abandoned the stage-end evaluation at ``update``: the resumed run runs it at its start."""

    def checkpoint_name(self) -> str:
        return f"ckpt_{self.update:06d}_s{self.stage:03d}_u{self.update_in_stage:05d}"

    def describe(self) -> str:
        return f"stage {self.stage}, update {self.update} ({self.update_in_stage} done in this stage)"


def kept_after_resume(eval_cfg, state: RLState) -> Callable[[dict], bool]:
    """Which metric records a run resumed at ``state`` keeps: records up to ``state.update``, the stage
    records of finished stages, and not the evaluation at ``state.update`` when the resumed run evaluates
    it again at its start (:func:`~mugrpo.evaluation.schedule.evaluates_at_start`; ``eval_cfg``: the
    resumed run's ``eval`` section), so no update or evaluation is logged twice."""
    again = evaluates_at_start(eval_cfg, state)

    def keep(record: dict) -> bool:
        if record.get("kind") == "stage":
            return record["stage"] < state.stage
        if record.get("kind") == "eval" and record.get("update", 0) == state.update:
            return not again
        return record.get("update", 0) <= state.update

    return keep
