"""One optimizer step, as every phase that trains takes it: micro-batches with FSDP2 filler passes,
gradient accumulation, and the clipped (or skipped) optimizer step.

RL (:meth:`mugrpo.training.trainer.Trainer.update`) and the supervised warm start
(:meth:`mugrpo.warmstart.phase.WarmStart.optimizer_step`) differ only in the loss of a micro-batch and in what
they sum for their metrics; everything around it is here, written once:

- :func:`device_batches`: the step's micro-batches on the device, padded with filler passes so every
  rank runs as many forwards as the busiest one (each is a collective under FSDP2);
- :func:`accumulate`: forward and backward of each micro-batch under ``no_sync`` but the last, filler
  passes discarded, a zero gradient for a rank with nothing to compute;
- :func:`step_optimizer`: clip, then step or skip a non-finite step (counted; an error after
  ``checkpoint.max_bad_updates`` in a row); :func:`check_some_steps_applied` at a phase's end.

Nothing here knows a loss, a stage or a config.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from mugrpo.kit import distributed as dist
from mugrpo.kit.batching import micro_batches
from mugrpo.kit.model_parts import TrainingError


def with_fillers(batches: list, make_filler: Callable[[], list]) -> tuple[list, int]:
    """(``batches`` padded with filler passes, the number of real ones).

    Under FSDP2 every rank must run as many forward(/backward) passes as the busiest one (each is a
    collective); a rank with fewer repeats its first micro-batch, or ``make_filler()``'s when it has
    none, and the caller discards those passes (loss times 0, results unused). One process: no filler.
    """
    real = len(batches)
    num_passes = dist.max_over_ranks(real)
    if real < num_passes:
        batches = batches + (batches[:1] or make_filler()) * (num_passes - real)
    return batches, real


def device_batches(data, seqs: list[int], filler_seqs: list[int], layout: dict, device) -> tuple[list, int]:
    """The micro-batches of sequences ``seqs`` of ``data`` (:func:`mugrpo.kit.batching.micro_batches`
    under ``layout``) on ``device``, with filler passes cut from ``filler_seqs``; (batches, real ones)."""
    return with_fillers([b.to(device) for b in micro_batches(data, seqs, **layout)],
                        lambda: [b.to(device) for b in micro_batches(data, filler_seqs, **layout)])


def accumulate(policy, batches: list, real: int, world, micro_loss: Callable[[Any], tuple[torch.Tensor, Any]]
               ) -> list:
    """Accumulate the step's gradient; returns ``micro_loss``'s second output for each real micro-batch.

    ``micro_loss(mb)`` -> (loss, out): the micro-batch's share of the step's loss (already divided by
    the whole step's normaliser, so the micro-batches' gradients add up to the step's). Each rank's
    loss is scaled by the world size because DDP/FSDP average gradients over ranks. Passes beyond
    ``real`` are fillers (:func:`with_fillers`): their collectives run, their loss counts 0 and their
    output is dropped. With no micro-batch at all the gradient is exactly zero, as the plain path's
    would be, and the optimizer still steps (AdamW's moments decay, weight decay applies).
    """
    outs = []
    for i, mb in enumerate(batches):
        with dist.no_sync_unless_last(policy, i == len(batches) - 1):
            loss, out = micro_loss(mb)
            if i >= real:  # a filler pass: the collectives run, nothing is added
                loss = loss * 0.0
            (loss * world.size).backward()
        if i < real:
            outs.append(out)
    if not batches:
        for p in policy.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    return outs


def step_optimizer(policy, optimizer, scheduler, state, max_grad_norm: float, max_bad_updates: int,
                   loss_value: float, what: str = "update") -> dict:
    """Clip the gradient to ``max_grad_norm``, then step, or skip a non-finite step (gradient norm or
    ``loss_value``), counting it in ``state`` (a :class:`mugrpo.kit.checkpoint.RunState`, whose
    ``update`` is the number of steps done before this one); the schedule always advances.
    TrainingError after ``max_bad_updates`` non-finite steps in a row. ``what``: the step's name in
    messages. Returns ``optim/lr`` (of this step), ``optim/grad_norm``, ``optim/skipped``,
    ``optim/num_skipped_updates``."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    out = {"optim/lr": scheduler.get_last_lr()[0], "optim/grad_norm": grad_norm}
    if not (math.isfinite(grad_norm) and math.isfinite(loss_value)):
        optimizer.zero_grad(set_to_none=True)
        state.bad_update_streak += 1
        state.num_skipped_updates += 1
        out["optim/skipped"] = 1.0
        # numbered as the metrics number it: the record of this step says update = state.update + 1
        print(f"[mugrpo] warning: {what} {state.update + 1} skipped: non-finite loss ({loss_value}) or gradient "
              f"norm ({grad_norm}); {state.bad_update_streak} in a row")
        if state.bad_update_streak >= max_bad_updates:
            raise TrainingError(f"{state.bad_update_streak} consecutive {what}s had a non-finite loss or "
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


def check_some_steps_applied(state, what: str, advice: str) -> None:
    """TrainingError when every step of a phase was skipped for a non-finite loss or gradient (the model
    never changed, so nothing is exported). ``what``: "updates" / "warm-start steps"; ``advice``: the fix."""
    if state.update and state.num_skipped_updates >= state.update:
        raise TrainingError(f"all {state.update} {what} of this run were skipped for a non-finite loss or "
                            f"gradient, so the model never changed; no model was written. {advice}")
