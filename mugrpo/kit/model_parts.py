"""The model side every phase that trains shares: the policy (LoRA, FSDP2), its tokenizer, the
optional reference model, the optimizer and its schedule (:func:`build_model`). One optimizer step
(accumulation, clipping, the skip of a non-finite step) is :mod:`mugrpo.kit.step`.

The RL loop (:mod:`mugrpo.training.trainer`) and the supervised warm start
(:mod:`mugrpo.warmstart.phase`) both build their model here, so LoRA, FSDP2, the tokenizer's checks
are one code path. Nothing here knows about losses, stages or data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mugrpo import heap
from mugrpo.config import Config
from mugrpo.config.plan import Plan
from mugrpo.errors import UserError
from mugrpo.models import lora
from mugrpo.models.loading import check_context, load_policy, load_tokenizer, resolve_model_path
from mugrpo.kit import distributed as dist


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
    warm start's exported model: :func:`mugrpo.pipeline.warm_start`)."""
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
    # Freed activations, gradients and moments go back to the system instead of staying resident as heap
    # holes (mugrpo/heap.py; 0.7 GiB off the default job's peak). Changes no computed value.
    heap.keep_large_blocks_mapped()
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
