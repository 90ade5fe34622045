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

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Protocol

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
    stop: tuple[str, ...] = ()
    """Strings that end a response early (multi-turn: e.g. the end of a tool call). The token that
    completes one is kept, nothing after it; empty = only EOS and max_new_tokens end a response."""


@dataclass
class Completion:
    token_ids: list[int]
    """Response tokens, the EOS token included when generation stopped on it."""
    behavior_logprobs: list[float]
    """One per token of ``token_ids``."""
    finish_reason: str
    """"stop" (EOS, or the token completing a ``SamplingConfig.stop`` string) or "length" (hit max_new_tokens)."""


ProgressFn = Callable[[int], None]
"""Called with the number of sequences just finished; an engine may also call it with 0 between
decode steps (the HF engine does), so that the caller can end a long call by raising from it."""


class RolloutEngine(Protocol):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights with the policy's (HF parameter names); may be streamed."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None,
                 max_new_tokens: Optional[list[int]] = None) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions for each tokenised prompt; result[i][j] is prompt i's j-th.

        A prompt is any token ids, e.g. a multi-turn trajectory so far. ``max_new_tokens`` (one per
        prompt, each at most ``sampling.max_new_tokens``) lowers the limit per prompt."""

    def sleep(self) -> None:
        """Release what memory the engine can (KV cache, weights on GPU) until ``wake``."""

    def wake(self) -> None:
        """Undo ``sleep``."""

    def close(self) -> None:
        """Free everything; the engine is unusable afterwards."""


def eos_ids(tokenizer, model_config=None, generation_config=None) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS plus the model's generation EOS."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if not ids:
        raise ValueError("the tokenizer has no eos_token; set tokenizer.eos_token so responses can end")
    return sorted(ids)


@contextlib.contextmanager
def weights_loaded(engine: RolloutEngine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[RolloutEngine]:
    """Wake ``engine``, push ``named_tensors`` into it, and put it back to sleep when the block ends
    (also when it raises): the sequence every generation phase, training or evaluation, runs."""
    engine.wake()
    engine.load_weights(named_tensors)
    try:
        yield engine
    finally:
        engine.sleep()
