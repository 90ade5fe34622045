"""The model side every phase that trains shares: the policy (LoRA, FSDP2), its tokenizer, the
optional reference model, the optimizer and its schedule (:func:`build_model`), and one optimizer
step with gradient clipping and the skip of a non-finite update (:func:`step_optimizer`).

The RL loop (:mod:`mugrpo.training.trainer`) and the supervised warm start
(:mod:`mugrpo.warmstart.phase`) both build their model here, so LoRA, FSDP2, the tokenizer's checks
and the non-finite skip are one code path. Nothing here knows about losses, stages or data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mugrpo.config import Config
from mugrpo.config.plan import Plan
from mugrpo.errors import UserError
from mugrpo.models import lora
from mugrpo.models.loading import check_context, load_policy, load_tokenizer, resolve_model_path
from mugrpo.training import distributed as dist


class TrainingError(UserError, RuntimeError):
    """Training cannot continue (e.g. too many non-finite updates in a row); the message says why."""


@dataclass
class ModelParts:
    """A run's model side, as every phase that trains builds it (:func:`build_model`)."""

    policy: torch.nn.Module
    """LoRA applied (``lora.*``), prepared for the world (FSDP2 under several ranks)."""
    ref_model: Any
    """The frozen reference model (``loss.kl_beta > 0``), else None."""
    device: Any
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    model_path: str
    """The HF model folder ``model.name`` resolves to (the same on every rank)."""


def build_model(cfg: Config, plan: Plan, world, with_ref: bool | None = None,
                model_path: str | None = None) -> ModelParts:
    """Load the tokenizer (its vocab checked against the model), the policy (with LoRA, prepared for
    the world), the reference model (``with_ref``; default ``loss.kl_beta > 0``), the optimizer and
    its schedule over ``plan.total_updates``. Seeds torch (``train.seed``) first.

    ``model_path``: an HF folder to load instead of ``model.name`` (a run with a warm start loads the
    warm start's exported model: :func:`mugrpo.warmstart.phase.warm_start_model`)."""
    _configure_torch(cfg)
    if model_path is None and world.is_main:
        model_path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    model_path = dist.broadcast_object(model_path)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)  # checks its vocab against the model
    check_context(model_path, cfg, cfg.model.trust_remote_code)
    policy = lora.apply_lora(load_policy(model_path, cfg.model.trust_remote_code), cfg.lora)
    with_ref = cfg.loss.kl_beta > 0 if with_ref is None else with_ref
    ref_model = load_policy(model_path, cfg.model.trust_remote_code).eval() if with_ref else None
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    policy, device = dist.prepare_model(policy, cfg, world)
    if ref_model is not None:
        ref_model = dist.prepare_frozen(ref_model, cfg, world)
    optimizer, scheduler = build_optimizer(policy, cfg, plan)
    return ModelParts(policy, ref_model, device, optimizer, scheduler, tokenizer, model_path)



def _configure_torch(cfg: Config) -> None:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.train.seed)


def build_optimizer(policy: torch.nn.Module, cfg: Config, plan: Plan):
    o = cfg.optim
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr,
                                  betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)

    def factor(step: int) -> float:
        if o.warmup_updates and step < o.warmup_updates:
            return (step + 1) / o.warmup_updates
        progress = (step - o.warmup_updates) / max(1, plan.total_updates - o.warmup_updates)
        if o.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if o.lr_schedule == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)




def step_optimizer(policy, optimizer, scheduler, state, max_grad_norm: float, max_bad_updates: int,
                   loss_value: float) -> dict:
    """Clip the gradient to ``max_grad_norm``, then step, or skip a non-finite update (gradient norm or
    ``loss_value``), counting it in ``state`` (a :class:`mugrpo.training.checkpoint.RunState`); the
    schedule always advances. TrainingError after ``max_bad_updates`` non-finite updates in a row.
    Returns ``optim/lr`` (of this step), ``optim/grad_norm``, ``optim/skipped``, ``optim/num_skipped_updates``."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    out = {"optim/lr": scheduler.get_last_lr()[0], "optim/grad_norm": grad_norm}
    if not (math.isfinite(grad_norm) and math.isfinite(loss_value)):
        optimizer.zero_grad(set_to_none=True)
        state.bad_update_streak += 1
        state.num_skipped_updates += 1
        out["optim/skipped"] = 1.0
        # state.update counts the finished updates: this one is the next, numbered as the metrics number it
        print(f"[mugrpo] warning: update {state.update + 1} skipped: non-finite loss ({loss_value}) or gradient "
              f"norm ({grad_norm}); {state.bad_update_streak} in a row")
        if state.bad_update_streak >= max_bad_updates:
            raise TrainingError(f"{state.bad_update_streak} consecutive updates had a non-finite loss or "
                                "gradient. Check the data (see stages/*/rollouts.jsonl); a lower optim.lr or "
                                "train.autocast=none needs a new run (--resume keeps the run's optimizer settings)")
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.bad_update_streak = 0
        out["optim/skipped"] = 0.0
    scheduler.step()
    out["optim/num_skipped_updates"] = state.num_skipped_updates
    return out
