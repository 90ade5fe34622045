"""Token log-probs and entropy from logits at a sampling temperature (ALGORITHM.md section 5).

Shapes: B sequences, T response tokens, V vocabulary. Pure functions on tensors.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[token] for each position, and optionally the entropy there.

    ``logits`` [B, T, V] are the logits that *predict* ``tokens`` [B, T] (already shifted).
    Computed in float32 whatever the logits' dtype, so bf16 autocast does not round the ratio.
    Entropy H = -sum_v p_v log p_v of the tempered distribution, [B, T] (None unless asked).
    """
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
