"""Group-normalised advantages, computed once at generation time (docs/ALGORITHM.md section 4).

Shapes: N prompt groups, G responses per group. Pure functions on tensors.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, std_scale: bool = True, eps: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = (r_i - mean_j r_j) / (std_j r_j + eps) within each group (row) of ``rewards`` [N, G].

    ``std_scale=False`` gives Dr. GRPO's A_i = r_i - mean_j r_j. The std is the population std
    (unbiased=False), as in the GRPO paper's group normalisation. Returns ``(advantages [N, G],
    zero_var [N] bool)``; a zero-variance group gets advantage exactly 0 for every member.
    """
    rewards = rewards.to(torch.float32)
    mean = rewards.mean(dim=1, keepdim=True)
    centered = rewards - mean
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    zero_var = zero_variance_groups(rewards)
    adv = centered / (std + eps) if std_scale else centered
    adv = torch.where(zero_var[:, None], torch.zeros_like(adv), adv)
    return adv, zero_var


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[N] bool for ``rewards`` [N, G]: every member of the group got the same reward (so A = 0 for all)."""
    return (rewards == rewards[:, :1]).all(dim=1)
