"""Per-turn views of token-level quantities on multi-turn trajectories (docs/ALGORITHM.md section 6a).

``turns`` [B, T] int: k >= 0 for a token of policy turn k, -1 for an environment token (the stage
data's layout, :mod:`mugrpo.stages.data`). The loss mask of multi-turn data already excludes
environment tokens, so :func:`mugrpo.algo.veto.veto_mask` needs no change across turns: triggers are
policy tokens, and the ``suffix`` scope drops every later policy token, later turns included.
These functions only say WHERE the veto acted, by turn.

Counts rather than fractions are returned where an update sums them over micro-batches and ranks
(then divides once), as every diagnostic in :mod:`mugrpo.algo.losses` does.

Shapes: B sequences, T response tokens, K turns counted (``num_turns``). Pure functions on tensors.
"""

from __future__ import annotations

import torch


def first_trigger_turn(first_trigger: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """[B] the turn of kappa_i (``VetoResult.first_trigger``), or -1 where nothing triggered."""
    has = first_trigger >= 0
    turn = turns.gather(1, first_trigger.clamp(min=0)[:, None]).squeeze(1).long()
    return torch.where(has, turn, torch.full_like(turn, -1))


def per_turn_counts(values: torch.Tensor, mask: torch.Tensor, turns: torch.Tensor, num_turns: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """([K] sum of ``values`` over the masked tokens of each turn, [K] number of those tokens).

    ``values`` [B, T] (e.g. the veto's ``vetoed`` as float), ``mask`` [B, T] the loss tokens;
    turns >= ``num_turns`` are folded into the last bucket (K - 1 means "turn K - 1 or later").
    vetoed fraction of turn k = sums[k] / counts[k] (0 tokens: no value; see :func:`safe_ratio`).
    """
    keep = mask.bool() & (turns >= 0)
    bucket = turns.long().clamp(max=num_turns - 1)[keep]
    sums = torch.zeros(num_turns, dtype=torch.float32, device=values.device)
    counts = torch.zeros(num_turns, dtype=torch.float32, device=values.device)
    sums.index_add_(0, bucket, values[keep].float())
    counts.index_add_(0, bucket, torch.ones_like(bucket, dtype=torch.float32))
    return sums, counts


def first_trigger_turn_counts(first_turn: torch.Tensor, num_turns: int) -> torch.Tensor:
    """[K] how many sequences had their first trigger in turn k (later turns folded into K - 1)."""
    turn = first_turn[first_turn >= 0].long().clamp(max=num_turns - 1)
    counts = torch.zeros(num_turns, dtype=torch.float32, device=first_turn.device)
    counts.index_add_(0, turn, torch.ones_like(turn, dtype=torch.float32))
    return counts


def safe_ratio(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """sums / counts elementwise, NaN where counts is 0 (a turn no sequence reached has no fraction)."""
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, float("nan")))


def turn_metrics(vetoed: torch.Tensor, first_trigger: torch.Tensor, mask: torch.Tensor, turns: torch.Tensor,
                 num_turns: int) -> dict[str, torch.Tensor]:
    """By-turn veto diagnostics as ``[numerator, denominator]`` pairs (the loss metrics' contract:
    summed over micro-batches and ranks, then divided once).

    ``loss/first_trigger_turn``: mean turn of kappa_i over sequences with a trigger;
    ``loss/veto_token_frac_turn{k}``: vetoed share of turn k's policy tokens (k = K - 1: that turn
    and later ones). ``vetoed`` and ``first_trigger`` are :class:`mugrpo.algo.veto.VetoResult`'s.
    """
    first = first_trigger_turn(first_trigger, turns)
    has = first >= 0
    metrics = {"loss/first_trigger_turn": torch.stack([torch.where(has, first, 0).sum().float(),
                                                       has.sum().float()])}
    sums, counts = per_turn_counts(vetoed, mask, turns, num_turns)
    for k in range(num_turns):
        metrics[f"loss/veto_token_frac_turn{k}"] = torch.stack([sums[k], counts[k]])
    return metrics
