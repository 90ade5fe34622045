"""The rollout-engine interface: what the trainer needs from anything that samples responses.

An engine owns its own copy of the policy weights for generation. Once per stage the trainer
pushes the current weights (``load_weights``), calls ``generate`` once with every prompt of the
stage, then ``sleep`` to release memory while it optimises, and ``wake`` before the next stage.

The engine knows nothing about rewards, advantages, the loss or the run directory.

Behaviour log-probs contract: ``Completion.behavior_logprobs[t]`` is log pi_b(y_t | q, y_<t) under
the distribution actually sampled from, i.e. after temperature / top-k / top-p processing. With
top-k and top-p off, that equals ``log_softmax(logits / temperature)`` at the sampled token, which
is what the trainer computes, so the first update of every stage sees ratio 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol

import torch


@dataclass(frozen=True)
class SamplingConfig:
    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """0 means greedy (evaluation only)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_new_tokens: int = 64
    seed: int = 0


@dataclass
class Completion:
    token_ids: list[int]
    """Response tokens, the EOS token included when generation stopped on it."""
    behavior_logprobs: list[float]
    """One per token of ``token_ids``."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (hit max_new_tokens)."""


ProgressFn = Callable[[int], None]
"""Called with the number of sequences just finished."""


class RolloutEngine(Protocol):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with the policy's (HF parameter names); may be streamed."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions for each tokenised prompt; result[i][j] is prompt i's j-th."""

    def sleep(self) -> None:
        """Release what memory the engine can (KV cache, weights on GPU) until ``wake``."""

    def wake(self) -> None:
        """Undo ``sleep``."""

    def close(self) -> None:
        """Free everything; the engine is unusable afterwards."""
