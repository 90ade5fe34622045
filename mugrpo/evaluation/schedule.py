"""When a training run evaluates: the in-loop rule, and what a resumed run evaluates again at its start.

One rule, read by the evaluator inside training (:class:`mugrpo.training.evaluator.TrainingEvaluator`)
and by a resume's truncation of ``metrics.jsonl`` (:mod:`mugrpo.kit.lifecycle`), so the two never
disagree. Pure functions of the ``eval`` config section and the run's position.
"""

from __future__ import annotations


def due_in_loop(eval_cfg, update: int) -> bool:
    """Whether the evaluator evaluates at ``update`` inside the loop: the initial policy
    (``eval.at_start``, update 0) and every ``eval.every_updates`` updates. A resumed run asks it before
    its first update too, so the resume's truncation of metrics.jsonl asks the same."""
    if update == 0:
        return bool(eval_cfg.at_start)
    return bool(eval_cfg.every_updates) and update % eval_cfg.every_updates == 0


def evaluated_again_at_start(eval_cfg, update: int) -> bool:
    """Whether a run resumed at ``update`` evaluates that update again when it starts (:func:`due_in_loop`,
    asked before the first update of every session). The evaluation a stage end ran
    (``eval.every_stages``) is not repeated."""
    return bool(eval_cfg.num_items) and due_in_loop(eval_cfg, update)


def evaluates_at_start(eval_cfg, state) -> bool:
    """Whether a run resumed at ``state`` evaluates ``state.update`` when it starts: when the in-loop
    rule asks (:func:`evaluated_again_at_start`) or a stop abandoned that stage end's evaluation."""
    return bool(eval_cfg.num_items) and (state.eval_pending or evaluated_again_at_start(eval_cfg, state.update))
