"""Aggregations: how [B, T] token losses become the step's loss, and what the step normalises by.

docs/ALGORITHM.md section 7. Each aggregation owns both halves of its normaliser contract:
:meth:`Aggregation.reduce` divides by ``denominator``, and :meth:`Aggregation.count` says what
``denominator`` counts (response tokens for ``token-mean``, sequences for the seq-mean modes), so
the caller sums ``count`` over the whole optimizer step (all micro-batches, all ranks) without
knowing which aggregation is on. Registered in :data:`mugrpo.algo.registries.AGGREGATORS`.

Pure functions on tensors; no config, no I/O. Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Aggregation:
    """One aggregation: ``per_sequence`` (normalise within a sequence by its kept-token count
    ``n_i``, by the constant L, or not at all) and ``unit`` (what the step's denominator counts)."""

    name: str
    unit: str
    """``"tokens"`` or ``"sequences"``."""
    per_sequence: str
    """``"none"`` (sum), ``"mean"`` (divide by n_i) or ``"sum-norm"`` (divide by L)."""

    def reduce(self, token_loss: torch.Tensor, keep: torch.Tensor, per_seq_count: torch.Tensor, *,
               denominator: torch.Tensor | float, seq_len_norm: int) -> torch.Tensor:
        """This micro-batch's share of the step loss.

        - none: sum_{i,t} l_it keep_it / denominator
        - mean (original GRPO): sum_i (sum_t l_it keep_it / n_i) / denominator
        - sum-norm (Dr. GRPO): sum_i sum_t l_it keep_it / L / denominator, L = ``seq_len_norm``
        """
        masked = token_loss * keep
        if self.per_sequence == "mean":
            return (masked.sum(1) / per_seq_count.clamp(min=1)).sum() / denominator
        if self.per_sequence == "sum-norm":
            return masked.sum() / seq_len_norm / denominator
        return masked.sum() / denominator

    def count(self, num_tokens: torch.Tensor, post_veto: bool) -> torch.Tensor:
        """Sequences' contribution to the step's denominator, from their token counts [B].

        ``num_tokens``: each sequence's response length, or (``post_veto``) its tokens the veto
        kept. tokens: their sum. sequences: how many; after the veto a sequence counts only if a
        token of it is left (a wholly vetoed sequence leaves the mean).
        """
        if self.unit == "tokens":
            return num_tokens.sum().to(torch.float64)
        if post_veto:
            return (num_tokens > 0).sum().to(torch.float64)
        return torch.tensor(float(num_tokens.numel()), dtype=torch.float64)


TOKEN_MEAN = Aggregation("token-mean", unit="tokens", per_sequence="none")
SEQ_MEAN_TOKEN_MEAN = Aggregation("seq-mean-token-mean", unit="sequences", per_sequence="mean")
SEQ_MEAN_TOKEN_SUM_NORM = Aggregation("seq-mean-token-sum-norm", unit="sequences", per_sequence="sum-norm")
