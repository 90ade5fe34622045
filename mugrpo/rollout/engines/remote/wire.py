"""The client's half of the serving contract (docs/SERVING.md, "The protocol"): one
``httpx.AsyncClient`` for every service, the three requests the remote engine sends (``GET /info``,
``POST /v1/completions``, ``POST /load_weights``), and the checks on their answers.

Errors: a service that cannot be reached, drops the connection or times out is :class:`Down` (the
caller moves its work); an answer with an error status, or one that is not what the contract says, is a
:class:`ServiceRefused` naming the URL (the run stops, exit 2); a 401 is :class:`Unauthorized`.
Connection attempts are retried by httpx's transport (``retries``); nothing else is retried here.

A completions request (OpenAI's fields with vLLM's extensions) carries token-id prompts and asks for the
sampled token's processed log-prob (``logprobs: 0``) and the token ids (``return_token_ids``). Only for
``engine=hf`` services the ``mugrpo`` field adds the chunk's index, the trainer's ``rollout.batch_size``
and per-prompt limits, which make the HF engine seed each chunk as the in-process engine does.

This module knows nothing about services' states, failover or weights versions (:mod:`.dispatch`).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import httpx
import torch

from mugrpo.errors import UserError
from mugrpo.rollout.engines.base import Completion, SamplingConfig

CONNECT_RETRIES = 2
"""Connection attempts httpx's transport repeats (with its own back-off: 0.5 s, 1 s) before a service
counts as unreachable."""
VERSION_HEADER, BOOT_HEADER = "x-mugrpo-weights-version", "x-mugrpo-boot-id"


class RemoteUnavailable(UserError):
    """No rollout service is left to generate with (each failed or stopped answering)."""


class ServiceRefused(UserError):
    """A rollout service that answers with another model, tokenizer, dtype or weights version, or with a
    malformed result; the message names its URL."""


class Unauthorized(ServiceRefused):
    """A service that answered 401: the trainer's ``rollout.remote.api_key`` is missing or wrong."""


class Down(Exception):
    """A service did not answer (refused or dropped connection, silence past the timeout, a restart)."""


def _detail(response: httpx.Response) -> str:
    """The error text of an answer: FastAPI's ``detail``, vLLM's ``error.message``, or the raw start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            value = body.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return value if isinstance(value, str) else json.dumps(value)[:300]
    return json.dumps(body)[:200]


class Http:
    """The engine's HTTP client (used from its event loop only). ``api_key``: sent as ``Authorization:
    Bearer``; ``timeout_s``: connecting, sending, and the whole of short requests (``/info``)."""

    def __init__(self, api_key: Optional[str], timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        # Services are never behind a proxy (trust_env=False); in-flight requests are bounded by the
        # dispatcher, so the pool is not.
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(retries=CONNECT_RETRIES, trust_env=False,
                                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)),
            headers=headers, timeout=httpx.Timeout(timeout_s), trust_env=False)

    async def request(self, url: str, path: str, body: Optional[dict] = None,
                      long: bool = False) -> tuple[dict, httpx.Headers]:
        """GET (``body`` None) or POST ``url + path``: the answer's JSON object and headers. ``long``: no
        read timeout (a generation or a weight load; the dispatcher watches ``/info`` meanwhile)."""
        timeout = httpx.Timeout(self.timeout_s, read=None, pool=None) if long else httpx.Timeout(self.timeout_s)
        try:
            if body is None:
                response = await self.client.get(url + path, timeout=timeout)
            else:
                response = await self.client.post(url + path, json=body, timeout=timeout)
        except httpx.TransportError as exc:  # refused, reset, timed out, cut off
            raise Down(f"{url}: {type(exc).__name__}: {exc or 'no answer'}") from None
        if response.status_code == 401:
            raise Unauthorized(f"the rollout service at {url} answered {path} with HTTP 401 ({_detail(response)}): "
                               "set the service's key as rollout.remote.api_key or in the environment variable "
                               "MUGRPO_API_KEY")
        if response.status_code >= 400:
            raise ServiceRefused(f"the rollout service at {url} refused {path} (HTTP {response.status_code}): "
                                 f"{_detail(response)}")
        try:
            answer = response.json()
        except ValueError:
            raw = response.content
            raise ServiceRefused(f"the rollout service at {url} answered {path} with malformed JSON ({len(raw)} "
                                 f"bytes: {raw[:80]!r}...); is that URL a mugrpo serve service?") from None
        if not isinstance(answer, dict):
            raise ServiceRefused(f"the rollout service at {url} answered {path} with {type(answer).__name__}, "
                                 "not an object")
        return answer, response.headers

    async def close(self) -> None:
        await self.client.aclose()


def prompt_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """One seed per prompt, the in-process vLLM engine's rule (``engines/vllm.py``,
    ``_sampling_params``): vLLM gives a prompt's n samples seeds s, s + 1, ...; so a vLLM service
    answering one request per prompt draws what one in-process call draws, however prompts are split."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - n, (num_prompts,), generator=gen).tolist()


def completions_body(model: str, prompts: list[list[int]], sampling: SamplingConfig, max_tokens: int,
                     seed: int, extra: dict) -> dict:
    """The ``/v1/completions`` request for ``prompts``. ``extra``: ``{"mugrpo": ...}`` for an HF service,
    ``{"stop_token_ids": ...}`` for a vLLM one."""
    greedy = sampling.temperature == 0
    return {"model": model, "prompt": prompts, "n": sampling.n, "max_tokens": max_tokens,
            "temperature": sampling.temperature, "top_p": 1.0 if greedy else sampling.top_p,
            "top_k": 0 if greedy else sampling.top_k, "seed": seed, "stop": list(sampling.stop),
            "include_stop_str_in_output": True, "logprobs": 0, "return_token_ids": True,
            "skip_special_tokens": False, **extra}


def completions_from_answer(answer: dict, num_prompts: int, n: int) -> list[list[Completion]]:
    """``choices`` (index = prompt i * n + j) as ``num_prompts`` groups of ``n`` completions; ValueError
    naming what is wrong (a missing or repeated index, token ids and log-probs of different lengths, an
    unknown finish reason)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != num_prompts * n:
        raise ValueError(f"expected {num_prompts * n} choices ({num_prompts} prompts x n={n}), got "
                         f"{len(choices) if isinstance(choices, list) else type(choices).__name__}")
    slots: list[Any] = [None] * len(choices)
    for c in choices:
        index = c.get("index") if isinstance(c, dict) else None
        if type(index) is not int or not 0 <= index < len(slots) or slots[index] is not None:
            raise ValueError(f"choice index {index!r} missing, out of range or repeated")
        logprobs = c.get("logprobs")
        ids = c.get("token_ids")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not (isinstance(ids, list) and isinstance(values, list) and len(ids) == len(values)
                and all(type(t) is int for t in ids) and all(isinstance(x, (int, float)) for x in values)):
            raise ValueError(f"choice {index}: token_ids and logprobs.token_logprobs must be lists of equal length "
                             "(ints and numbers)")
        if c.get("finish_reason") not in ("stop", "length"):
            raise ValueError(f"choice {index}: finish_reason {c.get('finish_reason')!r}")
        slots[index] = Completion(ids, [float(x) for x in values], c["finish_reason"])
    return [slots[i * n:(i + 1) * n] for i in range(num_prompts)]
