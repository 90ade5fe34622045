"""The adaptive stage (docs/ALGORITHM.md section 3a): when does the current stage end?

A fixed schedule ends every stage after mu updates. With ``schedule.adaptive`` a drift guard,
evaluated on the finalised metrics of the update just done, may end it earlier (never before
``adaptive_min_updates``); either way no stage runs past the run's budget of U updates. The
trainer takes this decision right after the update and BEFORE any checkpoint, so a checkpoint
is either mid-stage (the stage goes on) or the stage-end one; a resumed run replays the same
updates, gets bitwise the same metrics and so the same decisions. The guard keeps no history:
nothing about it needs to be in :class:`mugrpo.kit.checkpoint.RunState`.

The metrics are those of :func:`mugrpo.algo.losses.finalize_metrics`, already summed over ranks, so
every rank decides the same. Pure: plain floats in, a reason (or None) out; no config object is
needed beyond the schedule section, no tensors, no I/O.
"""

from __future__ import annotations

import math

KL_KEY = "loss/kl_behavior"
NEG_RATIO_KEY = "loss/ratio_mean_neg"

END_REASONS = ("mu", "budget", "kl", "neg_ratio")
"""Why a stage ended: ``mu`` updates done (the fixed length), the run's ``budget`` of U updates
reached first, or a guard tripped (``kl``, ``neg_ratio``). Logged as ``stage/end_reason``."""


def stage_length(updates_per_stage: int, total_updates: int, stage_start_update: int) -> int:
    """The most updates the stage that starts after ``stage_start_update`` updates may run."""
    return min(updates_per_stage, total_updates - stage_start_update)


def guard_trips(schedule, metrics: dict) -> str | None:
    """The guard that trips on this update's ``metrics`` (``kl`` before ``neg_ratio``), or None.

    ``kl``: k3 KL(behaviour -> current) > ``adaptive_kl_max``; ``neg_ratio``: E[rho | A<0] <
    ``adaptive_neg_ratio_min``. A missing or NaN metric (no trained token, no negative advantage in
    the update) never trips: there is no evidence of drift.
    """
    guard = schedule.adaptive
    if guard in ("kl", "kl_or_neg_ratio") and _value(metrics, KL_KEY) > schedule.adaptive_kl_max:
        return "kl"
    if guard in ("neg_ratio", "kl_or_neg_ratio") and _value(metrics, NEG_RATIO_KEY) < schedule.adaptive_neg_ratio_min:
        return "neg_ratio"
    return None


def end_reason(schedule, metrics: dict, updates_done: int, mu: int, max_length: int) -> str | None:
    """Why the stage ends after its ``updates_done``-th update, or None if it goes on.

    ``mu`` is the plan's (maximum) stage length; ``max_length`` is :func:`stage_length`: mu, or
    less where the budget ends first.
    """
    if updates_done >= max_length:
        return "mu" if max_length == mu else "budget"
    if schedule.adaptive == "none" or updates_done < schedule.adaptive_min_updates:
        return None
    return guard_trips(schedule, metrics)


def _value(metrics: dict, key: str) -> float:
    v = metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not math.isnan(float(v)) else math.nan
