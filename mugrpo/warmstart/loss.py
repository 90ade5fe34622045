"""The warm start's loss and its data order: pure functions on tensors and integers.

Shapes: S sequences in a micro-batch, R its longest response.
"""

from __future__ import annotations

import math

import torch

from mugrpo import seeds


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


def step_examples(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of optimizer step ``step``: consecutive slices of seeded reshuffles.

    Epoch e is permutation e of one generator seeded by :func:`mugrpo.seeds.sft_order`; step s
    takes positions s * batch_size .. (s + 1) * batch_size - 1 of the epochs laid end to end (a step
    may straddle two epochs). A pure function of (seed, step): a resume needs no sampler state.
    """
    start = step * batch_size
    first, last = start // num_examples, (start + batch_size - 1) // num_examples
    gen = torch.Generator().manual_seed(seeds.sft_order(seed))
    perms = [torch.randperm(num_examples, generator=gen) for _ in range(last + 1)]
    order = torch.cat(perms[first:])
    offset = start - first * num_examples
    return order[offset: offset + batch_size].tolist()


def num_steps(num_examples: int, batch_size: int, epochs: int, steps: int | None) -> int:
    """``steps`` if given, else epochs x ceil(num_examples / batch_size)."""
    return steps if steps is not None else epochs * math.ceil(num_examples / batch_size)
