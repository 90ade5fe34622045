"""Token log-probs and entropy from logits at a sampling temperature (docs/ALGORITHM.md section 5).

Shapes: B sequences, T response tokens, V vocabulary. Pure functions on tensors.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[token] for each position, and optionally the entropy there.

    ``logits`` [B, T, V] are the logits that *predict* ``tokens`` [B, T] (already shifted).
    Computed in float32 at least (float64 logits stay float64), so bf16 autocast does not round the ratio.
    Entropy H = -sum_v p_v log p_v of the tempered distribution, [B, T] (None unless asked).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits / T) at each position, [...] for ``logits`` [..., V], without gradient.

    Computed ``chunk`` positions at a time, so the float32 temporaries are [chunk, V] rather than
    the whole [..., V] (the entropy is a diagnostic; its memory should not scale with the batch).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk):
        logp = torch.log_softmax(flat[start:start + chunk].float() / temperature, dim=-1)
        out[start:start + chunk] = -(logp.exp() * logp).sum(-1)
    return out.view(logits.shape[:-1])
