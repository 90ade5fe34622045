"""The negative-advantage veto (docs/ALGORITHM.md section 6).

Only responses with A_i < 0 are touched. With the current policy (no gradient), a response token
*triggers* when rho_{i,t} < delta, compared in log space (log_ratio < log delta). kappa_i is the
first trigger. The scope decides which tokens leave the loss:

- ``none``              nothing
- ``trigger``           T_i, the trigger tokens only
- ``suffix``            S = {t > kappa_i}: every token after the first trigger (kappa itself stays)
- ``suffix_nontrigger`` S minus T_i
- ``sequence``          the whole response once any trigger appears

Shapes: B sequences, T response tokens. Pure functions on tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mugrpo.algo.registries import VETO_SCOPES


@dataclass
class VetoResult:
    vetoed: torch.Tensor
    """[B, T] bool: tokens removed from the loss (always inside ``mask``, only where A < 0)."""
    trigger: torch.Tensor
    """[B, T] bool: trigger tokens of A < 0 responses (whatever the scope)."""
    first_trigger: torch.Tensor
    """[B] long: kappa_i, the first trigger position, or -1 where there is none."""


def veto_mask(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              delta: float, scope: str) -> VetoResult:
    """Tokens to drop from the loss for ``log_ratio`` [B, T], ``advantages`` [B], ``mask`` [B, T].

    ``log_ratio`` = logprobs - behavior_logprobs; it is detached here: the veto is a data
    selection, never a gradient path.
    """
    if scope not in VETO_SCOPES:
        raise ValueError(f"unknown veto scope {scope!r}; choose one of {VETO_SCOPES}")
    mask = mask.bool()
    negative = (advantages < 0)[:, None]
    trigger = (log_ratio.detach() < math.log(delta)) & mask & negative
    seen = torch.cumsum(trigger.to(torch.int32), dim=1)  # triggers at or before t
    after_first = (seen - trigger.to(torch.int32)) > 0  # some trigger strictly before t: t > kappa
    if scope == "none":
        vetoed = torch.zeros_like(mask)
    elif scope == "trigger":
        vetoed = trigger
    elif scope == "suffix":
        vetoed = after_first & mask
    elif scope == "suffix_nontrigger":
        vetoed = after_first & mask & ~trigger
    else:  # sequence
        vetoed = trigger.any(dim=1, keepdim=True) & mask
    positions = torch.arange(trigger.shape[1], device=trigger.device).expand_as(trigger)
    first = torch.where(trigger, positions, torch.full_like(positions, trigger.shape[1])).min(dim=1).values
    first = torch.where(trigger.any(dim=1), first, torch.full_like(first, -1))
    return VetoResult(vetoed=vetoed, trigger=trigger, first_trigger=first)
