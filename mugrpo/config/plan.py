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

import dataclasses
import math
from dataclasses import dataclass

from mugrpo.config.presets import PRESETS
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
        *_trajectory_rows(cfg, resolved),
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
    note = staleness_note(cfg)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + (f"\nnote: {note}" if note else "")


# ---------------------------------------------------------------------------------------------
# The presets' staleness at this budget: ``grpo`` fixes mu = 4 updates per stage, the stale
# presets fix K = 4 stages (mu = U / 4), so below U = 16 the "stale" presets are the fresher ones, and at
# U = 16 every preset has the same schedule.


def _preset_mu(cfg: Config, preset: str) -> int | None:
    """mu of ``preset``'s schedule keys at this config's budget (None: not a valid schedule there)."""
    keys = {k.split(".", 1)[1]: v for k, v in PRESETS[preset].items() if k.startswith("schedule.")}
    try:
        return stage_shape(dataclasses.replace(cfg.schedule, **keys), cfg.rollout)[0]
    except ConfigError:
        return None


def preset_staleness(cfg: Config) -> dict[str, tuple[str, int]] | None:
    """Each preset's (kind, mu) at ``cfg``'s budget, kind ``fixed_mu`` (sets ``updates_per_stage``, e.g.
    grpo) or ``fixed_stages`` (sets ``num_stages``, the stale presets); None when the comparison does not
    apply: an adaptive schedule, or the config's own ``num_stages`` / ``updates_per_stage`` overriding its
    preset's (then every preset would run that same schedule)."""
    chosen = PRESETS.get(cfg.preset)
    s = cfg.schedule
    if chosen is None or s.adaptive != "none" or (s.num_stages, s.updates_per_stage) != (
            chosen.get("schedule.num_stages"), chosen.get("schedule.updates_per_stage")):
        return None
    out = {}
    for name, values in PRESETS.items():
        mu = _preset_mu(cfg, name)
        if mu is not None:
            out[name] = ("fixed_mu" if values.get("schedule.updates_per_stage") else "fixed_stages", mu)
    return out


def staleness_note(cfg: Config) -> str | None:
    """A note when, at this budget, the chosen preset's staleness is not on the side its kind is for: a
    stale preset (fixed K stages) as fresh as or fresher than ``grpo`` (fixed mu), or the reverse; with
    the overrides that restore the order (a larger ``schedule.total_updates``, or fewer stages on the
    stale runs). None when the order holds or the comparison does not apply."""
    table = preset_staleness(cfg)
    if not table or cfg.preset not in table:
        return None
    kind, mu = table[cfg.preset]
    fixed_mu = {n: m for n, (k, m) in table.items() if k == "fixed_mu"}
    stale = {n: m for n, (k, m) in table.items() if k == "fixed_stages"}
    if not fixed_mu or not stale or min(stale.values()) > max(fixed_mu.values()):
        return None
    fresh_mu, stale_mu = max(fixed_mu.values()), min(stale.values())
    others = fixed_mu if kind == "fixed_stages" else stale
    names = ", ".join(sorted(others))
    U = cfg.schedule.total_updates
    if stale_mu == fresh_mu:
        what = (f"{cfg.preset} and {names} have the same schedule (mu={mu} updates per stage, staleness "
                f"0 .. {mu - 1})")
    else:
        other_mu = fresh_mu if kind == "fixed_stages" else stale_mu
        what = (f"{cfg.preset} has mu={mu} updates per stage (staleness 0 .. {mu - 1}) and {names} mu={other_mu} "
                f"(0 .. {other_mu - 1}): the stale preset{'s are' if len(stale) > 1 else ' is'} the fresher")
    fixes = []
    larger = next((u for u in range(U + 1, 64 * U + 64) if _order_holds(cfg, u)), None)
    if larger is not None:
        fixes.append(f"schedule.total_updates={larger}")
    stages = [k for k in range(stale_num_stages(cfg) - 1, 0, -1) if U % k == 0 and U // k > fresh_mu]
    if stages:
        fixes.append(f"schedule.num_stages={stages[0]} on the stale presets' runs (mu={U // stages[0]})")
    return (f"at schedule.total_updates={U}, {what}, so comparing these presets compares only their clipping and "
            "veto, not staleness" + (f". To keep the comparison meaningful: {' or '.join(fixes)}" if fixes else ""))


def stale_num_stages(cfg: Config) -> int:
    """The number of stages the stale presets fix (4)."""
    return max(v.get("schedule.num_stages") or 0 for v in PRESETS.values())


def _order_holds(cfg: Config, total: int) -> bool:
    """At budget ``total``, every preset's schedule is valid and every stale one is staler than grpo."""
    table = preset_staleness(dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, total_updates=total)))
    if table is None or len(table) < len(PRESETS):
        return False
    fixed_mu = [m for k, m in table.values() if k == "fixed_mu"]
    return min(m for k, m in table.values() if k == "fixed_stages") > max(fixed_mu)


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


def _trajectory_rows(cfg: Config, resolved=None) -> list[tuple[str, str]]:
    """How multi-turn trajectories advance (a task with ``task.env`` or ``task.tools``; none otherwise):
    independently only on an engine that serves concurrent calls (the remote engine) without
    ``env.lockstep`` (:mod:`mugrpo.rollout.trajectories`)."""
    if not (cfg.task.env or cfg.task.tools):
        return []
    engine = resolved.engine if resolved is not None else cfg.rollout.engine
    if cfg.env.lockstep:
        how = "lock-step (env.lockstep=true: each turn of every trajectory in one engine call, then every step)"
    elif _serves_concurrent_calls(engine):
        how = (f"independent (each sends its next turn when its environment step returns; at most "
               f"{cfg.env.max_inflight} requests in flight, env.max_inflight)")
    else:
        how = (f"lock-step: rollout.engine={engine} serves one call at a time (in the trainer's process), so "
               "env.lockstep=false has no effect; a remote engine runs independent trajectories")
    return [("multi-turn trajectories", how)]


def _serves_concurrent_calls(engine: str) -> bool:
    """The engine class's ``concurrent`` (imported only for a multi-turn task on an engine other than the
    in-process ones)."""
    if engine in ("auto", "hf", "vllm"):
        return False
    from mugrpo.rollout.engines import ENGINES

    return getattr(ENGINES.get(engine), "concurrent", False) is True


def _async_row(plan: Plan) -> tuple[str, str]:
    """Stages generated ahead (``schedule.async_stages``, docs/ALGORITHM.md section 3c)."""
    k = plan.async_stages
    if not k:
        return ("stages generated ahead", "0 (synchronous: each stage generated, then optimised)")
    ahead = "s + 1" if k == 1 else f"s + 1 .. s + {k}"
    return ("stages generated ahead", f"{k} (stage {ahead} generated while stage s is optimised; policy lag "
                                      f"0 .. {k} stage{'s' if k > 1 else ''}, i.e. up to {k * plan.updates_per_stage}"
                                      f" + {plan.max_staleness} updates of staleness)")

