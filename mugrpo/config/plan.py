"""Stage planner: the schedule's derived quantities, computed once from the config (pure).

This module imports the config schema, never the reverse: the schedule's consistency rules live in
:func:`mugrpo.config.rules.stage_shape`, which both validation and :func:`make_plan` call.

Nothing here is written back into the config. ``mugrpo plan`` prints :func:`format_plan`.

Definitions (docs/ALGORITHM.md section 3):
- U = total updates = K stages x mu updates per stage.
- Each update draws ``prompts_per_update`` prompt groups (G sequences each) from the stage data,
  shuffled, cycling through several passes when mu x prompts_per_update > prompts_per_stage.
- Staleness of update j (0-based) inside a stage = j: the number of optimizer updates since the
  behaviour snapshot was taken.
- Stages generated ahead (``schedule.async_stages`` = k): stage s's data comes from the policy as of
  stage s - k's start (the first k + 1 stages: the initial policy), so a sequence's policy lag is
  0 .. k stages, and its staleness at update j of its stage up to k x mu + j updates.
- Adaptive stages (``schedule.adaptive`` != none, :mod:`mugrpo.algo.adaptive`): mu is the MAXIMUM stage
  length and U the budget, so the number of stages is variable, between U / mu and
  ceil(U / adaptive_min_updates); ``num_stages`` and ``weight_syncs`` are then None and only
  ``min_stages`` / ``max_stages`` bound them. Code that runs the schedule goes by updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mugrpo.config.rules import stage_shape
from mugrpo.config.schema import Config
from mugrpo.errors import ConfigError
from mugrpo.algo import dynamic


@dataclass(frozen=True)
class Plan:
    num_stages: int | None
    """K; None with adaptive stages (variable: ``min_stages`` .. ``max_stages``)."""
    updates_per_stage: int
    total_updates: int
    prompts_per_stage: int
    group_size: int
    prompts_per_update: int
    sequences_per_stage: int
    sequences_per_update: int
    world_size: int
    sequences_per_update_per_rank: int
    micro_batch_tokens: int
    micro_batch_size: int | None
    passes_per_stage: float
    max_staleness: int
    weight_syncs: int | None
    """One per stage: ``num_stages`` (None with adaptive stages)."""
    adaptive: str = "none"
    min_updates_per_stage: int = 0
    """Adaptive: no stage ends before this many updates (unless the budget does); fixed: mu."""
    min_stages: int = 0
    max_stages: int = 0
    async_stages: int = 0
    """k: stages generated ahead (0: synchronous); stage data lags the policy by at most k stages."""


def make_plan(cfg: Config, world_size: int = 1) -> Plan:
    """Derive the schedule from ``cfg.schedule`` and ``cfg.rollout``; raise ConfigError if impossible."""
    s, r = cfg.schedule, cfg.rollout
    total = s.total_updates
    mu, stages, prompts_per_stage = stage_shape(s, r)  # the schedule's own consistency, with its messages
    seq_per_update = s.prompts_per_update * r.group_size
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if s.prompts_per_update % world_size or prompts_per_stage % world_size:
        raise ConfigError(
            f"schedule.prompts_per_update={s.prompts_per_update} and rollout.prompts_per_stage="
            f"{prompts_per_stage} must both be divisible by the number of ranks ({world_size}), "
            "so that whole prompt groups stay on one rank"
        )
    per_rank = seq_per_update // world_size
    adaptive = s.adaptive != "none"
    min_len = s.adaptive_min_updates if adaptive else mu
    return Plan(
        num_stages=None if adaptive else stages,
        updates_per_stage=mu,
        total_updates=total,
        prompts_per_stage=prompts_per_stage,
        group_size=r.group_size,
        prompts_per_update=s.prompts_per_update,
        sequences_per_stage=prompts_per_stage * r.group_size,
        sequences_per_update=seq_per_update,
        world_size=world_size,
        sequences_per_update_per_rank=per_rank,
        micro_batch_tokens=s.micro_batch_tokens,
        micro_batch_size=s.micro_batch_size,
        passes_per_stage=mu * s.prompts_per_update / prompts_per_stage,
        max_staleness=mu - 1,
        weight_syncs=None if adaptive else stages,
        adaptive=s.adaptive,
        min_updates_per_stage=min_len,
        min_stages=stages,
        max_stages=math.ceil(total / min_len),
        async_stages=s.async_stages,
    )


def format_plan(plan: Plan, cfg: Config, resolved=None) -> str:
    """The plan as an aligned table; with ``resolved`` (:class:`mugrpo.hardware.Resolved`) also the
    machine and the concrete values of the ``auto`` settings."""
    micro = f"{plan.micro_batch_tokens} tokens"
    if plan.micro_batch_size is not None:
        micro += f", at most {plan.micro_batch_size} sequences"
    rows = [
        ("preset", cfg.preset),
        *_stage_rows(plan, cfg),
        ("prompts per stage", plan.prompts_per_stage),
        ("group size (G)", plan.group_size),
        ("sequences per stage", plan.sequences_per_stage),
        ("prompts per update", plan.prompts_per_update),
        ("sequences per update", plan.sequences_per_update),
        ("ranks", plan.world_size),
        ("sequences per update per rank", plan.sequences_per_update_per_rank),
        ("micro-batch budget", micro),
        ("passes over each stage's data", f"{'at most ' if plan.num_stages is None else ''}{plan.passes_per_stage:g}"),
        ("staleness range (updates)", f"0 .. {plan.max_staleness}"),
        _async_row(plan),
        ("clip range", cfg.loss.describe()),
        ("veto", "none" if cfg.loss.veto_scope == "none"
         else f"{cfg.loss.veto_scope}, delta={cfg.loss.veto_delta:g}"),
        ("zero-advantage skip", "on" if cfg.train.skip_zero_advantage else "off"),
        *dynamic.plan_rows(cfg.rollout.dynamic_sampling, dynamic.groups_needed(
            plan.prompts_per_stage, plan.prompts_per_update, plan.updates_per_stage), plan.group_size,
            cfg.rollout.dynamic_oversample, cfg.rollout.dynamic_max_rounds, plan.world_size),
        ("shared-prefix forward", "on" if cfg.train.shared_prefix else "off"),
    ]
    if resolved is not None:
        rows += [
            ("device", resolved.hardware.describe()),
            ("trainer precision", f"{'bf16 autocast' if resolved.autocast == 'bf16' else 'float32'}"
                                  f" (train.autocast={cfg.train.autocast})"),
            ("rollout engine", f"{resolved.engine}, {resolved.engine_dtype} (rollout.engine={cfg.rollout.engine}, "
                               f"rollout.dtype={cfg.rollout.dtype})"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _stage_rows(plan: Plan, cfg: Config) -> list[tuple[str, object]]:
    """Stages, stage length, budget and syncs: exact for a fixed schedule, bounds for an adaptive one."""
    if plan.num_stages is not None:
        return [("stages (K)", plan.num_stages), ("updates per stage (mu)", plan.updates_per_stage),
                ("total updates (U)", plan.total_updates), ("weight syncs", plan.weight_syncs)]
    s = cfg.schedule
    guard = {"kl": f"KL(behaviour -> current) > {s.adaptive_kl_max:g}",
             "neg_ratio": f"E[rho | A<0] < {s.adaptive_neg_ratio_min:g}",
             "kl_or_neg_ratio": f"KL(behaviour -> current) > {s.adaptive_kl_max:g} or E[rho | A<0] < "
                                f"{s.adaptive_neg_ratio_min:g}"}[plan.adaptive]
    between = f"{plan.min_stages} .. {plan.max_stages}"
    return [("stages (K)", f"variable, {between} (adaptive: U/mu .. ceil(U/min updates))"),
            ("updates per stage (mu)", f"{plan.min_updates_per_stage} .. {plan.updates_per_stage} "
                                       "(fewer only where the budget ends)"),
            ("stage ends early when", f"{guard} after an update"),
            ("total updates (U)", f"{plan.total_updates} (the budget, whatever the number of stages)"),
            ("weight syncs", f"one per stage: {between}")]


def _async_row(plan: Plan) -> tuple[str, str]:
    """Stages generated ahead (``schedule.async_stages``, docs/ALGORITHM.md section 3c)."""
    k = plan.async_stages
    if not k:
        return ("stages generated ahead", "0 (synchronous: each stage generated, then optimised)")
    ahead = "s + 1" if k == 1 else f"s + 1 .. s + {k}"
    return ("stages generated ahead", f"{k} (stage {ahead} generated while stage s is optimised; policy lag "
                                      f"0 .. {k} stage{'s' if k > 1 else ''}, i.e. up to {k * plan.updates_per_stage}"
                                      f" + {plan.max_staleness} updates of staleness)")

