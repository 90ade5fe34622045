"""The warm start's loss and its step count: pure functions on tensors and integers (its data order is
the trainer kit's, :func:`mugrpo.kit.order.step_examples`).

Shapes: S sequences in a micro-batch, R its longest response.
"""

from __future__ import annotations

import math

import torch



def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked token-mean negative log-likelihood: (loss, the summed NLL, detached).

    loss = -sum_{s,t} mask[s,t] * logprobs[s,t] / num_tokens, with ``logprobs`` [S, R] the policy's
    log-probs of the demonstrated tokens (temperature 1) and ``mask`` [S, R] the trained tokens.
    **Normaliser**: ``num_tokens`` is the trained-token count of the whole optimizer step (every
    micro-batch, every rank), not of this micro-batch, so the summed gradient of the step's micro-
    batches is the gradient of the step's token mean whatever the micro-batching (TRL's SFT loss with
    ``assistant_only_loss``, taken per step rather than per micro-batch).
    """
    nll = -(logprobs * mask.to(logprobs.dtype)).sum()
    return nll / num_tokens, nll.detach()


def num_steps(num_examples: int, batch_size: int, epochs: int, steps: int | None) -> int:
    """``steps`` if given, else epochs x ceil(num_examples / batch_size)."""
    return steps if steps is not None else epochs * math.ceil(num_examples / batch_size)
