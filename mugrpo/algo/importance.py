"""Truncated importance sampling between the engine's and the trainer's log-probs: pure math.

docs/ALGORITHM.md section 5b; where the weights are used: :mod:`mugrpo.stages.tis`.
Tensors in, tensors out; no model, no config. Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import math

import torch

from mugrpo.algo.losses import LOG_RATIO_GUARD, k3


def tis_weights(trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(pi_trainer / pi_engine, C) per token, detached [B, T], computed in log space.

    ``behavior_logprobs`` are the engine's (the distribution that sampled the token). E.g. log-probs
    -1.0 (trainer) and -1.5 (engine) give w = e^0.5 = 1.65 below C = 2; -0.5 and -1.5 give e^1 = 2.72,
    capped to 2. The log-ratio is clamped below at -LOG_RATIO_GUARD (a numeric guard).
    """
    d = (trainer_logprobs - behavior_logprobs).detach()
    return torch.exp(d.clamp(min=-LOG_RATIO_GUARD, max=math.log(cap)))


def mismatch_sums(trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Sums over tokens (1-D inputs, real tokens only) of the engine-vs-trainer mismatch, float64 [5]:

    [ |d|, k3(d), 1(w capped), w, number of tokens ] with d = log pi_trainer - log pi_engine. k3(d) =
    e^d - d - 1 estimates KL(pi_engine || pi_trainer) from tokens sampled by the engine.
    """
    d = (trainer_logprobs - behavior_logprobs).double()
    kl = k3(d.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD))
    capped = (d > math.log(cap)).double()
    w = tis_weights(trainer_logprobs.double(), behavior_logprobs.double(), cap)
    return torch.stack([d.abs().sum(), kl.sum(), capped.sum(), w.sum(), torch.tensor(float(d.numel()),
                                                                                       dtype=torch.float64)])
