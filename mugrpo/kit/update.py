"""The update step's rules outside the loss math: layout, filler passes, normaliser, ratio inputs.

What an optimizer update needs besides the loss itself (:mod:`mugrpo.algo.losses`), in one place,
used by the trainer's update (:meth:`mugrpo.training.trainer.Trainer.update`) and by the trainer-side
behaviour log-prob recompute (:mod:`mugrpo.stages.tis`):

- :class:`StepSettings`: the loss options (:class:`~mugrpo.algo.losses.LossSettings`, the only route
  the loss config takes) plus the batching knobs; built from the run config by the trainer, so
  nothing here reads the config;
- the micro-batch layout (:meth:`StepSettings.layout`) (the FSDP2 filler passes and the accumulation:
  :mod:`mugrpo.kit.step`);
- which log-probs a ratio is taken against (:func:`ratio_inputs`);
- the step's loss normaliser (:func:`normaliser`), counted by the aggregation itself
  (:meth:`mugrpo.algo.aggregation.Aggregation.count`), with the post-veto count when asked.

Not here: the loss (algo), the micro-batch packing (:mod:`mugrpo.kit.batching`), the forward
(:mod:`mugrpo.kit.forward`), the optimizer and its step (the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mugrpo.algo.importance import tis_weights
from mugrpo.algo.losses import LossSettings
from mugrpo.algo.registries import AGGREGATORS
from mugrpo.algo.veto import veto_mask
from mugrpo.kit.batching import MicroBatch, sequences_to_train
from mugrpo.kit.forward import response_logprobs, shared_prefix_support

if TYPE_CHECKING:  # read by attribute (mugrpo.stages sits above the kit)
    from mugrpo.stages.data import StageData


@dataclass(frozen=True)
class StepSettings:
    """Everything an update's layout and normaliser need besides tensors and the model."""

    loss: LossSettings
    temperature: float
    autocast: bool
    """bf16 autocast for the trainer's forwards (the resolved ``train.autocast``)."""
    skip_zero_advantage: bool
    shared_prefix: bool
    micro_batch_tokens: int
    micro_batch_size: int | None

    @property
    def skip(self) -> bool:
        """Leave A = 0 sequences out of the forward: asked for, and exact (no KL / entropy term)."""
        return self.skip_zero_advantage and self.loss.zero_advantage_is_inert

    def to_train(self, data: StageData, seqs: list[int]) -> list[int]:
        """The sequences of ``seqs`` the forward must compute (:func:`sequences_to_train`)."""
        return sequences_to_train(data, seqs, self.skip)

    def layout(self, policy) -> dict:
        """The keyword arguments of :func:`mugrpo.kit.batching.micro_batches` for ``policy``."""
        shared, mask_dtype, _ = shared_prefix_support(policy) if self.shared_prefix else (False, None, "")
        return dict(shared=shared, budget=self.micro_batch_tokens, max_seqs=self.micro_batch_size, pad_id=0,
                    mask_dtype=mask_dtype or torch.bool)


def ratio_inputs(mb: MicroBatch, loss: LossSettings) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the log-probs the ratio is taken against, the TIS weights or None) for a micro-batch."""
    if loss.behavior_logprobs == "engine":
        return mb.behavior_logprobs, None
    if mb.trainer_logprobs is None:
        raise ValueError("loss.behavior_logprobs=trainer but the stage data carries no trainer log-probs")
    return mb.trainer_logprobs, tis_weights(mb.trainer_logprobs, mb.behavior_logprobs, loss.tis_cap)


def normaliser(policy, data: StageData, seqs: list[int], trained: list[int], batches: list, real: int,
               step: StepSettings) -> torch.Tensor:
    """This rank's share of the update's loss normaliser, counted over ALL of ``seqs``, skipped ones included.

    The aggregation says what it counts (tokens or sequences); tokens are POLICY tokens (the
    environment tokens of multi-turn data are inputs, never loss tokens). With ``loss.veto_normalizer=post_veto``
    the vetoed tokens (or wholly vetoed sequences) leave the count, which takes one extra no-grad
    forward of the trained micro-batches (the veto needs the current log-probs). A skipped sequence
    has A = 0, which the veto never touches, so it counts in full. ``batches`` beyond the first
    ``real`` are filler passes (FSDP2 collectives): run, not counted.
    """
    aggregation = AGGREGATORS.get(step.loss.aggregation)
    if not step.loss.post_veto:
        lengths = torch.tensor([data.num_policy_tokens(s) for s in seqs], dtype=torch.long)
        return torch.tensor(float(aggregation.count(lengths, post_veto=False)))
    trained_set = set(trained)
    skipped = torch.tensor([data.num_policy_tokens(s) for s in seqs if s not in trained_set], dtype=torch.long)
    kept = float(aggregation.count(skipped, post_veto=True))
    return torch.tensor(kept + kept_after_veto(policy, batches, real, step))


@torch.no_grad()
def kept_after_veto(policy, batches: list, real: int, step: StepSettings) -> float:
    """The normaliser's count over the trained micro-batches after the veto (current log-probs)."""
    aggregation, s = AGGREGATORS.get(step.loss.aggregation), step.loss
    kept = 0.0
    for i, mb in enumerate(batches):
        logprobs, _ = response_logprobs(policy, mb, step.temperature, step.autocast, False, False)
        if i >= real:
            continue
        veto = veto_mask(logprobs - ratio_inputs(mb, s)[0], mb.advantages, mb.response_mask,
                         delta=s.veto_delta, scope=s.veto_scope)
        keep = mb.response_mask & ~veto.vetoed
        kept += float(aggregation.count(keep.sum(1), post_veto=True))
    return kept
