"""The remote engine (``rollout.engine=remote``): generation by ``mugrpo serve`` services over HTTP
(docs/SERVING.md is the user's guide; the serving contract is in its "The protocol").

Token ids in, token ids and behaviour log-probs out (``POST /v1/completions``): nothing is re-tokenized,
so the stage data is what the services' engines produced. A call is cut into chunks that the
dispatcher (:mod:`.dispatch`) sends to the next free service:

- HF services: a chunk is the HF engine's own chunk of ``rollout.batch_size`` sequences, and its request
  carries the chunk's index (``mugrpo.first_chunk``), so the service seeds it as the in-process engine
  seeds that chunk: one or several HF services give exactly what the in-process HF engine gives,
  whichever service takes which chunk, also after a failover.
- vLLM services: a chunk is one prompt, with the seed the in-process vLLM engine gives that prompt and
  its own ``max_tokens``: the samples do not depend on how prompts are spread over services (vLLM's
  continuous batching takes many requests at once).

Threads: the HTTP work runs on an asyncio loop in one background thread (httpx), behind the same
synchronous interface as every engine. ``generate`` may be called from several threads at once
(``concurrent = True``: stages generated ahead, evaluations, independent trajectories); ``load_weights``
waits for the calls in flight and holds new ones (a reader-writer lock), so every answer of a call comes
from one weights version (each answer's ``x-mugrpo-weights-version`` header is checked; ``generate_version``
says which). ``progress`` is called from the calling thread, at least every half second (with 0
between chunks: the caller's chance to stop a call).

Weights: :mod:`.weights` writes one safetensors file per version into ``rollout.remote.weights_dir``
(rank 0 only, under torchrun); every service loads it by name from its ``--weights-dir``; the ranks
> 0 wait until each service reports the version. Checks at start: every URL answers (else ConfigError
naming ``rollout.remote.urls``; a 401: ``rollout.remote.api_key``), with the trainer's model config,
tokenizer and engine dtype, and all services run one engine kind (else :class:`ServiceRefused`).

This module knows nothing about rewards, the loss or the run directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from pathlib import Path
from typing import Iterable, Optional
from urllib.parse import urlsplit

import torch

from mugrpo.errors import ConfigError
from mugrpo.rollout.engines.base import Completion, ProgressFn, SamplingConfig, eos_ids
from mugrpo.rollout.engines.remote.dispatch import RESUME_HINT, Chunk, Dispatcher, Limits, Service
from mugrpo.rollout.engines.remote.weights import WeightsFolder, default_weights_dir
from mugrpo.rollout.engines.remote.wire import (Down, Http, RemoteUnavailable, ServiceRefused, Unauthorized,
                                                completions_body, completions_from_answer, prompt_seeds)
from mugrpo.rollout.service import model_fingerprint, tokenizer_fingerprint

__all__ = ["RESUME_HINT", "RemoteEngine", "RemoteUnavailable", "ServiceRefused", "default_weights_dir"]

DEFAULT_IN_FLIGHT = {"hf": 2, "vllm": 64}
"""Requests in flight per service when ``rollout.remote.max_in_flight`` is null: an HF service runs one
at a time (a second one waits behind it, so the service never idles between chunks); a vLLM service
batches what it holds."""


class ReadWriteLock:
    """Many readers (``generate`` calls) or one writer (a weight load); a writer that waits holds new
    readers back, so a load is never starved by a stream of calls."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers, self._writer, self._waiting = 0, False, 0

    @contextlib.contextmanager
    def reading(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self):
        with self._cond:
            self._waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Loop:
    """An asyncio loop in a daemon thread; :meth:`wait` runs a coroutine there from any thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mugrpo-remote", daemon=True)
        self.thread.start()

    def wait(self, coro, progress: Optional[ProgressFn] = None, done: Optional[list] = None):
        """The coroutine's result; meanwhile ``progress(k)`` every half second with the sequences finished
        since (``done[0]``, counted by the coroutine). An exception from ``progress`` cancels the coroutine."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        reported = 0
        try:
            while True:
                concurrent.futures.wait([future], timeout=0.5)
                if progress is not None:
                    now = done[0] if done else 0
                    if not future.done() or now != reported:
                        progress(now - reported)  # 0 between chunks: the caller's chance to stop the call
                        reported = now
                if future.done():
                    return future.result()
        except BaseException:
            future.cancel()
            with contextlib.suppress(BaseException):
                future.result(timeout=5)
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


class RemoteEngine:
    """A :class:`~mugrpo.rollout.engines.base.RolloutEngine` whose generation runs in ``mugrpo serve``
    services (``rollout_cfg.remote``: urls, api_key, weights_dir, timeout_s, retries, stall_timeout_s,
    max_in_flight)."""

    concurrent = True

    def __init__(self, model_path: str, tokenizer, rollout_cfg, seed: int = 0):
        r = rollout_cfg.remote
        if not r.urls:
            raise ConfigError("rollout.engine=remote needs rollout.remote.urls (start services with mugrpo serve)")
        if len(set(r.urls)) != len(r.urls):
            raise ConfigError(f"rollout.remote.urls={r.urls} lists a URL twice; list each service once")
        self.batch_size, self.dtype, self.max_in_flight = rollout_cfg.batch_size, rollout_cfg.dtype, r.max_in_flight
        self.rank = int(os.environ.get("RANK", "0"))
        self.weights = WeightsFolder(Path(r.weights_dir or default_weights_dir()))
        if self.rank == 0:
            self.weights.prepare()  # dead trainers' files removed; a folder it cannot write: exit 2 now
        self.eos = _eos(model_path, tokenizer)
        self.generate_version = 0
        """The weights version the last ``generate`` call's completions came from. Versions continue from
        the highest one the services held at start (a service never goes back to a lower one)."""
        self._rw = ReadWriteLock()
        self._loop = _Loop()
        poll_s = min(1.0, r.timeout_s / 2)
        limits = Limits(r.timeout_s, r.stall_timeout_s, r.retries, poll_s, probe_s=max(poll_s, min(5.0, r.timeout_s)))
        want = {"model_fingerprint": model_fingerprint(model_path),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "dtype": self.dtype}
        api_key = r.api_key or os.environ.get("MUGRPO_API_KEY") or None
        try:
            self.dispatch = self._loop.wait(self._connect(r.urls, api_key, limits, model_path, want))
        except BaseException:
            self._loop.close()
            raise

    # -- start-up --------------------------------------------------------------------------------------

    async def _connect(self, urls, api_key, limits: Limits, model_path: str, want: dict) -> Dispatcher:
        http = Http(api_key, limits.timeout_s)
        try:
            infos = await asyncio.gather(*(self._info(http, url.rstrip("/"), model_path, want) for url in urls))
        except BaseException:
            await http.close()
            raise
        engines = {info.get("engine") for info in infos}
        if len(engines) != 1:
            await http.close()
            raise ServiceRefused("rollout.remote.urls mixes engines (" + ", ".join(
                f"{u}: {i.get('engine')}" for u, i in zip(urls, infos)) + "); give services of one engine")
        services = [Service(url.rstrip("/"), str(info.get("boot_id")), str(info.get("engine")), str(info.get("model")),
                            self.max_in_flight or DEFAULT_IN_FLIGHT.get(info.get("engine"), 2))
                    for url, info in zip(urls, infos)]
        held = max((i.get("weights_version") for i in infos if type(i.get("weights_version")) is int), default=0)
        return Dispatcher(http, services, limits, version=held)  # versions go on from the highest one held

    @staticmethod
    async def _info(http: Http, url: str, model_path: str, want: dict) -> dict:
        try:
            info, _ = await http.request(url, "/info")
        except Down as exc:
            raise ConfigError(f"rollout.remote.urls: the rollout service at {url} does not answer ({exc}); start "
                              f"it (mugrpo serve --model MODEL --port PORT) or fix the URL") from None
        except Unauthorized as exc:
            raise ConfigError(f"rollout.remote.api_key: {exc}") from None
        theirs = {k: info.get(k) for k in want}
        if theirs["model_fingerprint"] != want["model_fingerprint"]:
            raise ServiceRefused(f"the rollout service at {url} serves another model: {info.get('model')} (config "
                                 f"{theirs['model_fingerprint']}), the trainer's is {model_path} (config "
                                 f"{want['model_fingerprint']}); start the service with --model {model_path}")
        if theirs["tokenizer_fingerprint"] != want["tokenizer_fingerprint"]:
            raise ServiceRefused(f"the rollout service at {url} has another tokenizer: {info.get('model')} (tokenizer "
                                 f"{theirs['tokenizer_fingerprint']}), the trainer's {model_path} (tokenizer "
                                 f"{want['tokenizer_fingerprint']}); serve the trainer's model folder")
        if theirs["dtype"] != want["dtype"]:
            raise ServiceRefused(f"the rollout service at {url} runs in {theirs['dtype']}, the trainer's rollout.dtype "
                                 f"resolves to {want['dtype']}; restart it with --dtype {want['dtype']} or set "
                                 f"rollout.dtype={theirs['dtype']}")
        return info

    # -- what tests and logs read ----------------------------------------------------------------------

    @property
    def services(self) -> list[Service]:
        return self.dispatch.services

    @property
    def version(self) -> int:
        return self.dispatch.version

    @property
    def weights_path(self) -> Optional[str]:
        """Rank 0: the file the services hold now (None before the first load)."""
        return str(self.weights.files[-1]) if self.weights.files else None

    def metrics(self) -> dict[str, float]:
        """Since start: ``perf/remote_chunks/HOST:PORT`` (chunks each service answered) and
        ``perf/remote_failovers`` (times a service left)."""
        out = {f"perf/remote_chunks/{urlsplit(s.url).netloc}": float(s.num_chunks) for s in self.services}
        out["perf/remote_failovers"] = float(sum(s.num_failures for s in self.services))
        return out

    # -- weights ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights as the next version (rank 0) and have every live service load it; other ranks
        take part in the gather, then wait for the services to report the version. Waits for the
        ``generate`` calls in flight; new ones wait for it."""
        with self._rw.writing():
            version = self.dispatch.version + 1
            if self.rank != 0:
                for _ in named_tensors:  # each item is a collective under FSDP2: every rank consumes them
                    pass
                self._loop.wait(self.dispatch.await_version(version))
                return
            path = self.weights.write(named_tensors, self.dtype, version)
            self._loop.wait(self.dispatch.load(version, path.name))
            self.weights.remove_before(path)

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None,
                 max_new_tokens: Optional[list[int]] = None) -> list[list[Completion]]:
        if not prompts:
            return []
        with self._rw.reading():
            version, done = self.dispatch.version, [0]
            out = self._loop.wait(self._generate(prompts, sampling, max_new_tokens, done), progress, done)
            self.generate_version = version
            return out

    async def _generate(self, prompts, sampling: SamplingConfig, max_new_tokens, done: list) -> list:
        hf = self.services[0].engine == "hf"
        per_chunk = max(1, self.batch_size // sampling.n) if hf else 1
        limits = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        seeds = None if hf else prompt_seeds(sampling.seed, len(prompts), sampling.n)

        def send(s: Service, chunk: Chunk):
            if hf:
                extra = {"mugrpo": {"first_chunk": chunk.start // per_chunk, "batch_size": self.batch_size,
                                    "max_tokens": None if max_new_tokens is None else limits[chunk.start:chunk.stop]}}
                body = completions_body(s.model, prompts[chunk.start:chunk.stop], sampling, sampling.max_new_tokens,
                                        sampling.seed, extra)
            else:
                body = completions_body(s.model, prompts[chunk.start:chunk.stop], sampling, limits[chunk.start],
                                        seeds[chunk.start], {"stop_token_ids": self.eos})
            return self.dispatch.http.request(s.url, "/v1/completions", body, long=True)

        async def one(chunk: Chunk) -> list:
            groups = await self.dispatch.run_chunk(
                chunk, send, lambda s, answer: completions_from_answer(answer, chunk.stop - chunk.start, sampling.n))
            done[0] += len(groups) * sampling.n
            return groups

        chunks = [Chunk(a, min(a + per_chunk, len(prompts))) for a in range(0, len(prompts), per_chunk)]
        tasks = [asyncio.ensure_future(one(c)) for c in chunks]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # an error, or the caller's stop: the other chunks' requests are dropped
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:  # the first error in chunk order
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [group for t in tasks for group in t.result()]

    # -- memory ----------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Nothing: the services' memory is theirs (on their own devices)."""

    def wake(self) -> None:
        """Nothing (see ``sleep``)."""

    def close(self) -> None:
        """Remove this engine's weights files, stop its background work; the services keep running for
        the next trainer. Idempotent."""
        self.weights.close()
        if getattr(self, "_loop", None) is not None and self._loop.loop.is_running():
            with contextlib.suppress(BaseException):
                self._loop.wait(self.dispatch.close())
            self._loop.close()


def _eos(model_path: str, tokenizer) -> list[int]:
    """Every id that ends a response (sent to vLLM services as ``stop_token_ids``, as the in-process vLLM
    engine sets them)."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        generation_config = None
    return eos_ids(tokenizer, generation_config=generation_config)
