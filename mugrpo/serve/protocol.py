"""The request schema of the HF service's ``POST /v1/completions`` (the subset of OpenAI's completions and
vLLM's extensions that the HF engine honours, plus mugrpo's ``mugrpo`` field) and the bounds every request
is held to. The vLLM service validates with vLLM's own request models; the bounds that vLLM lacks
(``n``, sequences per request) are checked for both by :func:`bound_problem`.

Fields are strict (``"8"`` is not 8) and unknown fields are refused, so a client's mistake comes back as a
400 naming the field and the accepted values, never as a silently ignored option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=256)]


class MugrpoExtension(BaseModel):
    """What an HF service needs to sample exactly what the in-process HF engine samples (engines/hf.py):
    the trainer's chunking, and per-prompt limits. Only engine=hf services take it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    first_chunk: int = Field(0, ge=0, le=2**31 - 1)
    """Index, in the trainer's whole call, of this request's first chunk of ``batch_size`` sequences (each
    chunk's seed follows its index)."""
    batch_size: Optional[int] = Field(None, ge=1, le=65536)
    """The trainer's ``rollout.batch_size`` (sequences per HF generate call); null: the service's
    ``--batch-size``."""
    max_tokens: Optional[list[Annotated[int, Field(ge=1)]]] = None
    """One limit per prompt, each at most the request's ``max_tokens``; null: ``max_tokens`` for all."""


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` on an HF service: token-id prompts only, no streaming."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = Field(None, max_length=1024)
    prompt: Union[list[list[TokenId]], list[TokenId]] = Field(min_length=1)
    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """0: greedy."""
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    """0 or -1: off (as vLLM)."""
    seed: Optional[int] = Field(0, ge=0, le=2**63 - 1)
    stop: Union[StopString, list[StopString], None] = Field(None)
    include_stop_str_in_output: bool = True
    logprobs: Optional[Literal[0]] = 0
    """0: the sampled token's log-prob (the only one the HF engine records); null: none returned."""
    return_token_ids: bool = True
    return_tokens_as_token_ids: Optional[bool] = None
    skip_special_tokens: bool = True
    """For the answer's ``text`` only (stop strings are matched on text without special tokens)."""
    echo: Literal[False] = False
    stream: Literal[False] = False
    ignore_eos: Literal[False] = False
    user: Optional[str] = Field(None, max_length=256)
    mugrpo: Optional[MugrpoExtension] = None

    def prompts(self) -> list[list[int]]:
        return self.prompt if isinstance(self.prompt[0], list) else [self.prompt]  # type: ignore[list-item]

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


@dataclass(frozen=True)
class Limits:
    """What one request may ask of a service (``mugrpo serve`` flags)."""

    max_n: int = 256
    """``--max-n``: samples per prompt."""
    max_seqs: int = 4096
    """``--max-seqs``: sequences per request (prompts x n)."""
    max_model_len: int = 2048
    """The model's context (prompt + new tokens)."""
    max_stops: int = 16


def bound_problem(num_prompts: int, n: int, limits: Limits) -> Optional[str]:
    """The message for a request past ``n`` or sequence bounds (both engines), None when within them."""
    if n > limits.max_n:
        return f"n: {n} samples per prompt is above this service's limit of {limits.max_n} (--max-n)"
    if num_prompts * n > limits.max_seqs:
        return (f"prompt, n: {num_prompts} prompts x n={n} = {num_prompts * n} sequences is above this service's "
                f"limit of {limits.max_seqs} per request (--max-seqs); send fewer prompts per request")
    return None


def request_problem(req: CompletionRequest, limits: Limits, vocab_size: int) -> Optional[str]:
    """What is wrong with an HF completions request beyond its schema (bounds, token ids, lengths), or None."""
    prompts = req.prompts()
    problem = bound_problem(len(prompts), req.n, limits)
    if problem:
        return problem
    if len(req.stops()) > limits.max_stops:
        return f"stop: {len(req.stops())} stop strings, at most {limits.max_stops}"
    if req.stops() and not req.include_stop_str_in_output:
        return "include_stop_str_in_output: the HF service keeps the token that completes a stop string; send true"
    own = req.mugrpo.max_tokens if req.mugrpo and req.mugrpo.max_tokens is not None else None
    if own is not None and (len(own) != len(prompts) or max(own) > req.max_tokens):
        return (f"mugrpo.max_tokens: one limit per prompt ({len(prompts)}), each in 1..max_tokens ({req.max_tokens}); "
                f"got {len(own)} limits, the largest {max(own, default=0)}")
    for i, p in enumerate(prompts):
        if not p:
            return f"prompt: prompt {i} is empty; each prompt needs at least one token id"
        if max(p) >= vocab_size:
            return f"prompt: prompt {i} has token id {max(p)}; the model's ids are 0..{vocab_size - 1}"
        room = own[i] if own is not None else req.max_tokens
        if len(p) + room > limits.max_model_len:
            what = f"mugrpo.max_tokens[{i}]" if own is not None else "max_tokens"
            most = max(0, limits.max_model_len - len(p))
            return (f"{what}: prompt {i} has {len(p)} tokens; with {room} new tokens it passes the model's context "
                    f"of {limits.max_model_len} tokens (max_model_len); at most {most}")
    return None
