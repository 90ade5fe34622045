"""The rules that span config sections, in one place, and the listing of resume-safe keys.

:func:`validate` runs every section's own ``validate()`` (:mod:`mugrpo.config.schema`), then the
cross-section rules. :func:`stage_shape` is the schedule arithmetic that validation and the planner
(:func:`mugrpo.config.plan.make_plan`) share: plan imports it, the config never imports plan.
"""

from __future__ import annotations

import dataclasses
import warnings

from mugrpo.config.schema import Config, OptimConfig, RolloutConfig, ScheduleConfig
from mugrpo.errors import ConfigError


def validate(cfg: Config) -> None:
    """Every section's own checks, then the rules that span sections (this is their one place);
    raises ConfigError naming the key."""
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            value.validate()
    if cfg.parallel.activation_checkpointing and cfg.model.gradient_checkpointing:
        raise ConfigError("parallel.activation_checkpointing and model.gradient_checkpointing are both true; they "
                          "do the same thing two ways. Keep parallel.activation_checkpointing (works with FSDP2) "
                          "and set model.gradient_checkpointing=false")
    if cfg.schedule.async_stages and cfg.loss.behavior_logprobs == "trainer":
        raise ConfigError(f"schedule.async_stages={cfg.schedule.async_stages} and loss.behavior_logprobs=trainer do "
                          "not combine: the trainer-side behaviour log-probs are recomputed with the policy that generated "
                          "the stage, which has moved on by the time a stage generated ahead is ready. Set "
                          "schedule.async_stages=0, or loss.behavior_logprobs=engine")
    if cfg.schedule.async_stages and cfg.lora.rank and cfg.lora.dropout and cfg.rollout.engine != "remote":
        raise ConfigError(f"schedule.async_stages={cfg.schedule.async_stages} and lora.dropout={cfg.lora.dropout} do "
                          f"not combine with an in-process engine (rollout.engine={cfg.rollout.engine}): the trainer's "
                          "dropout and the engine's seeded sampling would draw from torch's one global generator in "
                          "two threads at once, so neither the stages nor the updates could be reproduced or resumed "
                          "exactly. Set lora.dropout=0, schedule.async_stages=0, or rollout.engine=remote (the "
                          "engine in its own process: mugrpo serve)")
    stage_shape(cfg.schedule, cfg.rollout)
    _warn_warmup(cfg.optim, cfg.schedule)


def _warn_warmup(o: OptimConfig, s: ScheduleConfig) -> None:
    if o.warmup_updates > s.total_updates:
        warnings.warn(f"optim.warmup_updates={o.warmup_updates} exceeds schedule.total_updates={s.total_updates}: "
                      "the learning rate never reaches optim.lr", stacklevel=3)


def stage_shape(s: ScheduleConfig, r: RolloutConfig) -> tuple[int, int, int]:
    """(mu updates per stage, K stages, prompts per stage) of a consistent schedule; ConfigError naming
    the keys otherwise. The planner (:func:`mugrpo.config.plan.make_plan`) derives the rest from it."""
    total = s.total_updates
    if s.updates_per_stage is not None and s.num_stages is not None:
        if s.updates_per_stage * s.num_stages != total:
            raise ConfigError(
                f"schedule.num_stages={s.num_stages} x schedule.updates_per_stage={s.updates_per_stage} = "
                f"{s.num_stages * s.updates_per_stage} updates, but schedule.total_updates={total}; "
                "set one of them to null (it is derived) or make them agree")
        mu, stages = s.updates_per_stage, s.num_stages
    elif s.updates_per_stage is not None:
        mu = s.updates_per_stage
        if total % mu:
            raise ConfigError(f"schedule.total_updates={total} is not a multiple of schedule.updates_per_stage={mu}")
        stages = total // mu
    else:
        stages = s.num_stages
        if total % stages:
            raise ConfigError(f"schedule.total_updates={total} is not a multiple of schedule.num_stages={stages}")
        mu = total // stages
    prompts_per_stage = r.prompts_per_stage if r.prompts_per_stage is not None else mu * s.prompts_per_update
    if s.prompts_per_update > prompts_per_stage:
        raise ConfigError(
            f"schedule.prompts_per_update={s.prompts_per_update} exceeds rollout.prompts_per_stage="
            f"{prompts_per_stage}: one update would need more prompts than a stage generates")
    if s.adaptive != "none" and s.adaptive_min_updates > mu:
        raise ConfigError(f"schedule.adaptive_min_updates={s.adaptive_min_updates} exceeds the maximum stage length "
                          f"mu={mu} (schedule.updates_per_stage, or total_updates / num_stages); lower it or raise mu")
    return mu, stages, prompts_per_stage


def resume_safe_keys(cls: type = Config, prefix: str = "") -> tuple[str, ...]:
    """Dotted keys marked ``resume_safe`` (a section marked whole ends in '.'): a resume may change them."""
    keys: list[str] = []
    hints = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in hints.items():
        key = f"{prefix}{name}"
        if f.metadata.get("resume_safe"):
            keys.append(f"{key}." if _section_type(f) else key)
        elif _section_type(f):
            keys.extend(resume_safe_keys(_section_type(f), f"{key}."))
    return tuple(keys)


def _section_type(f: dataclasses.Field):
    """The dataclass a section field holds (its default factory), or None for a plain value."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None

