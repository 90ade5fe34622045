"""The remote engine (``rollout.engine=remote``): generation by ``mugrpo serve`` services over HTTP
(:mod:`mugrpo.rollout.service` is the other side; docs/SERVING.md the user's guide).

Token ids in, token ids and behaviour log-probs out: nothing is re-tokenized, so the stage data is what
the service's in-process engine produced. A single HF service gives exactly what the in-process HF
engine gives (same seeds, same chunks: each request carries ``rollout.batch_size`` and the index of its
first chunk); several HF services give it too, since the prompts are split at chunk boundaries.

Weights (the shared-folder channel): ``load_weights`` writes one safetensors file, atomically (a
temporary name, then a rename), into ``rollout.remote.weights_dir`` with a version number in its name,
asks every service to load it, and checks that each reports that version. The previous file is then
removed. Under torchrun only rank 0 writes; the other ranks wait until every service reports the
version. NCCL broadcast into GPU services is future work (docs/SERVING.md).

Checks: at construction every URL must answer (else ConfigError naming ``rollout.remote.urls``), with
the trainer's model config, tokenizer and engine dtype (else :class:`ServiceRefused` naming the URL and
both sides). Every answer is checked: its weights version must be the current one, its shape and lengths
right; a service that answers otherwise is refused, naming its URL.

Faults: a service that cannot be reached, drops a connection, stops answering ``/info`` for
``rollout.remote.timeout_s`` while it works, restarts (a new ``boot_id``), or whose engine makes no
progress for ``rollout.remote.stall_timeout_s`` (``/info``'s ``since_progress_s``: a stuck engine behind a
server that still answers) loses its part of the call, which goes to another live service (at most ``rollout.remote.retries`` moves per part). At the next call
every service is asked again: one that is back gets the current weights before it is used. With no
service left, :class:`RemoteUnavailable` says which URLs failed and how to resume. The retried part
carries its own seeds, so with HF services the stage is the same whichever service generates it.

``generate`` and ``load_weights`` may be called from any thread (e.g. a background stage generator); a lock
makes them take turns, so a sync waits for the call in flight and every answer of a call comes from one
weights version (``generate_version`` says which). A call starts its own threads, one per service, and
calls ``progress`` from the calling thread.

This module knows nothing about rewards, the loss or the run directory.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import tempfile
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from mugrpo.errors import ConfigError, UserError
from mugrpo.run_dir import atomic_write
from mugrpo.rollout.engines.base import Completion, ProgressFn, SamplingConfig
from mugrpo.rollout.service import (completions_from_json, model_fingerprint, sampling_to_json,
                                    tokenizer_fingerprint)

RESUME_HINT = ("once a service answers again (mugrpo serve ...), continue the run with: mugrpo train --resume "
               "RUN_DIR (the stage in flight is generated again)")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # services are never behind a proxy


class RemoteUnavailable(UserError):
    """No rollout service is left to generate with (each failed or stopped answering)."""


class ServiceRefused(UserError):
    """A rollout service that answers with another model, tokenizer, dtype or weights version, or with a
    malformed result; the message names its URL."""


class _Down(Exception):
    """A service did not answer (refused connection, dropped connection, silence past the timeout, a restart)."""


def default_weights_dir() -> str:
    """``/dev/shm/mugrpo-weights`` where ``/dev/shm`` exists, else ``mugrpo-weights`` in the system temp folder."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, "mugrpo-weights")


def request_json(url: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> dict:
    """GET (``body`` None) or POST ``url + path``; the answer's JSON object. Raises :class:`_Down` when the
    service cannot be reached or the answer is cut off, :class:`ServiceRefused` for an error status or a
    body that is not a JSON object."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", "")
        except (ValueError, AttributeError, OSError):
            detail = ""
        raise ServiceRefused(f"the rollout service at {url} refused {path} (HTTP {exc.code}): {detail}") from exc
    except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, IncompleteRead
        raise _Down(f"{url}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}") from exc
    try:
        answer = json.loads(raw)
    except ValueError as exc:
        raise ServiceRefused(f"the rollout service at {url} answered {path} with malformed JSON ({len(raw)} bytes: "
                             f"{raw[:80]!r}...); is that URL a mugrpo serve service?") from exc
    if not isinstance(answer, dict):
        raise ServiceRefused(f"the rollout service at {url} answered {path} with {type(answer).__name__}, "
                             "not an object")
    return answer


@dataclass
class _Service:
    url: str
    boot_id: str = ""
    alive: bool = True
    failure: str = ""
    """Why it was last taken as dead (for the error when none is left)."""
    refusal: Optional[ServiceRefused] = None
    """Set when it refused a weight load (raised once every push has ended)."""


@dataclass
class _Part:
    start: int
    stop: int
    failed_on: list = field(default_factory=list)


def split_parts(num_prompts: int, per_chunk: int, num_services: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) prompt ranges, one per service at most, cut at multiples of ``per_chunk``
    (the HF engine's chunk of prompts), as even as whole chunks allow: 5 chunks of 2 over 2 services ->
    chunks 3 + 2 -> [(0, 6), (6, 10)] for 10 prompts."""
    num_chunks = -(-num_prompts // per_chunk)
    parts, first = [], 0
    for i in range(min(num_services, num_chunks)):
        chunks = num_chunks // num_services + (1 if i < num_chunks % num_services else 0)
        parts.append((first * per_chunk, min(num_prompts, (first + chunks) * per_chunk)))
        first += chunks
    return parts


class RemoteEngine:
    """A :class:`~mugrpo.rollout.engines.base.RolloutEngine` whose generation runs in ``mugrpo serve``
    services (``rollout_cfg.remote``: urls, weights_dir, timeout_s, retries, stall_timeout_s)."""

    def __init__(self, model_path: str, tokenizer, rollout_cfg, seed: int = 0):
        r = rollout_cfg.remote
        if not r.urls:
            raise ConfigError("rollout.engine=remote needs rollout.remote.urls (start services with mugrpo serve)")
        if len(set(r.urls)) != len(r.urls):
            raise ConfigError(f"rollout.remote.urls={r.urls} lists a URL twice; list each service once")
        self.timeout_s, self.retries, self.batch_size = r.timeout_s, r.retries, rollout_cfg.batch_size
        self.stall_timeout_s = r.stall_timeout_s
        self.dtype = rollout_cfg.dtype
        self.poll_s = min(1.0, self.timeout_s / 2)
        self.rank = int(os.environ.get("RANK", "0"))
        self.weights_dir = Path(r.weights_dir or default_weights_dir())
        self.version, self.weights_path = 0, None
        self.generate_version = 0
        """The weights version the last ``generate`` call's completions came from (0: the services' own)."""
        self._lock = threading.Lock()
        self._token = uuid.uuid4().hex[:12]
        want = {"model_fingerprint": model_fingerprint(model_path),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "dtype": self.dtype}
        self.services = [self._connect(url.rstrip("/"), model_path, want) for url in r.urls]

    # -- start-up --------------------------------------------------------------------------------------

    def _connect(self, url: str, model_path: str, want: dict) -> _Service:
        try:
            info = request_json(url, "/info", timeout=self.timeout_s)
        except _Down as exc:
            raise ConfigError(f"rollout.remote.urls: the rollout service at {url} does not answer ({exc}); start "
                              f"it (mugrpo serve --model MODEL --port PORT) or fix the URL") from None
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
        return _Service(url, boot_id=str(info.get("boot_id")))

    # -- weights ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the weights as version ``self.version + 1`` (rank 0) and have every live service load
        it; other ranks take part in the gather, then wait for the services to report the version."""
        with self._lock:
            self._load_weights(named_tensors)

    def _load_weights(self, named_tensors) -> None:
        self.version += 1
        if self.rank != 0:
            for _ in named_tensors:  # each item is a collective under FSDP2: every rank consumes them
                pass
            self._await_version()
            return
        previous, self.weights_path = self.weights_path, self._write(named_tensors)
        threads = [threading.Thread(target=self._push_quietly, args=(s,), daemon=True) for s in self._live()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._live()  # none left: RemoteUnavailable
        for s in self.services:
            if s.refusal is not None:
                refusal, s.refusal = s.refusal, None
                raise refusal
        if previous and previous != self.weights_path:
            Path(previous).unlink(missing_ok=True)

    def _write(self, named_tensors) -> str:
        from safetensors.torch import save_file

        dtype = getattr(torch, self.dtype)
        state = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in named_tensors}
        if not state:
            raise ValueError("RemoteEngine.load_weights got no tensors; the services keep their old weights")
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        final = self.weights_dir / f"mugrpo-{self._token}-v{self.version:06d}.safetensors"
        atomic_write(final, lambda tmp: save_file(state, str(tmp)))  # a service never sees a half-written file
        return str(final)

    def _push(self, s: _Service) -> None:
        """Have ``s`` load the current file; raises _Down (it is gone) or ServiceRefused."""
        answer = self._call(s, "/load_weights", {"path": self.weights_path, "version": self.version})
        if answer.get("weights_version") != self.version:
            raise ServiceRefused(f"the rollout service at {s.url} reports weights version "
                                 f"{answer.get('weights_version')!r} after loading version {self.version}")

    def _push_quietly(self, s: _Service) -> None:
        try:
            self._push(s)
        except _Down as exc:
            s.alive, s.failure = False, str(exc)
        except ServiceRefused as exc:
            s.refusal = exc

    def _await_version(self) -> None:
        """Ranks > 0: wait until every live service reports this version (rank 0 writes and pushes it)."""
        import time

        for s in self._live():
            deadline = time.monotonic() + 20 * self.timeout_s
            while True:
                try:
                    info = request_json(s.url, "/info", timeout=self.timeout_s)
                except _Down as exc:
                    s.alive, s.failure = False, str(exc)
                    break
                if info.get("weights_version") == self.version:
                    s.boot_id, self.weights_path = str(info.get("boot_id")), info.get("weights_path")
                    break
                if time.monotonic() > deadline:
                    raise RemoteUnavailable(f"the rollout service at {s.url} did not reach weights version "
                                            f"{self.version} (rank 0 writes it) within {20 * self.timeout_s:g} s")
                time.sleep(self.poll_s)
        self._live()

    def _refresh(self) -> None:
        """Ask every service how it is, before a call: one that restarted (or came back) gets the current
        weights; one that holds weights this engine did not push is refused."""
        for s in self.services:
            try:
                info = request_json(s.url, "/info", timeout=self.timeout_s)
            except _Down as exc:
                s.alive, s.failure = False, str(exc)
                continue
            stuck = self._stuck(s, info)
            if stuck:
                s.alive, s.failure = False, stuck
                continue
            boot, version, path = str(info.get("boot_id")), info.get("weights_version"), info.get("weights_path")
            if boot == s.boot_id and s.alive and self.version and (version, path) != (self.version, self.weights_path):
                raise ServiceRefused(f"the rollout service at {s.url} holds weights version {version!r} from {path}, "
                                     f"not this trainer's version {self.version} from {self.weights_path}: is another "
                                     "trainer using it? Give each trainer its own services")
            s.boot_id, s.alive = boot, True
            if self.version and (version, path) != (self.version, self.weights_path):
                try:
                    self._push(s)  # restarted: back to the current weights before any use
                except _Down as exc:
                    s.alive, s.failure = False, str(exc)

    def _live(self) -> list[_Service]:
        live = [s for s in self.services if s.alive]
        if not live:
            raise RemoteUnavailable("no rollout service is left: " + "; ".join(
                f"{s.url} ({s.failure})" for s in self.services) + f". {RESUME_HINT}")
        return live

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 progress: Optional[ProgressFn] = None,
                 max_new_tokens: Optional[list[int]] = None) -> list[list[Completion]]:
        if not prompts:
            return []
        with self._lock:
            out = self._generate(prompts, sampling, progress, max_new_tokens)
            self.generate_version = self.version
            return out

    def _generate(self, prompts, sampling, progress, max_new_tokens) -> list[list[Completion]]:
        self._refresh()
        per_chunk = max(1, self.batch_size // sampling.n)
        parts = [_Part(a, b) for a, b in split_parts(len(prompts), per_chunk, len(self._live()))]
        call = _Call(self, parts, lambda p: {
            "prompts": prompts[p.start:p.stop], "sampling": sampling_to_json(sampling),
            "max_new_tokens": None if max_new_tokens is None else max_new_tokens[p.start:p.stop],
            "batch_size": self.batch_size, "first_chunk": p.start // per_chunk}, sampling.n)
        results = call.run(progress)
        return [group for part in parts for group in results[id(part)]]

    def _call(self, s: _Service, path: str, body: dict) -> dict:
        """POST ``body`` to ``s`` and wait for the answer, asking ``/info`` every ``poll_s`` meanwhile: no
        answer there within ``timeout_s``, or a new boot_id, and ``s`` is taken as gone (_Down)."""
        box: dict = {}

        def send():
            try:
                box["answer"] = request_json(s.url, path, body)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        while True:
            sender.join(self.poll_s)
            if not sender.is_alive():
                break
            try:
                info = request_json(s.url, "/info", timeout=self.timeout_s)
            except _Down as exc:
                raise _Down(f"{s.url} stopped answering while it worked on {path} ({exc})") from None
            if str(info.get("boot_id")) != s.boot_id:
                raise _Down(f"{s.url} restarted while it worked on {path}")
            stuck = self._stuck(s, info)
            if stuck:
                raise _Down(stuck)
        if "error" in box:
            raise box["error"]
        return box["answer"]

    def _stuck(self, s: _Service, info: dict) -> str:
        """Why ``s`` is taken as stuck ("" if it is not): its engine has held a generate request without a
        decode step for longer than ``rollout.remote.stall_timeout_s``."""
        since = info.get("since_progress_s")
        if isinstance(since, (int, float)) and since > self.stall_timeout_s:
            return (f"{s.url} answers, but its engine made no progress for {since:.0f} s on a generate request "
                    f"(rollout.remote.stall_timeout_s={self.stall_timeout_s:g}); is it stuck? Restart it")
        return ""

    def generate_part(self, s: _Service, body: dict, n: int) -> list[list[Completion]]:
        """One part on one service, its answer checked (version, restart, shape)."""
        answer = self._call(s, "/generate", body)
        if str(answer.get("boot_id")) != s.boot_id:
            raise _Down(f"{s.url} restarted before it answered")
        if answer.get("weights_version") != self.version:
            raise ServiceRefused(f"the rollout service at {s.url} answered with weights version "
                                 f"{answer.get('weights_version')!r}, not the current {self.version}; refused")
        try:
            return completions_from_json(answer.get("completions"), len(body["prompts"]), n)
        except ValueError as exc:
            raise ServiceRefused(f"the rollout service at {s.url} answered /generate with a malformed result: "
                                 f"{exc}; refused") from None

    # -- memory ----------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Nothing: the services' memory is theirs (on their own devices)."""

    def wake(self) -> None:
        """Nothing (see ``sleep``)."""

    def close(self) -> None:
        """Remove this engine's weights file; the services keep running for the next trainer."""
        if self.rank == 0 and self.weights_path:
            Path(self.weights_path).unlink(missing_ok=True)
        self.weights_path = None


class _Call:
    """One ``generate`` call spread over the live services: a worker thread per service takes parts from a
    shared queue; a part whose service fails goes back to the queue for another. The calling thread
    waits, reports progress and raises the first fatal error."""

    def __init__(self, engine: RemoteEngine, parts: list[_Part], body, n: int):
        self.engine, self.body, self.n = engine, body, n
        self.queue = collections.deque(parts)
        self.remaining, self.results = len(parts), {}
        self.cond = threading.Condition()
        self.error: Optional[BaseException] = None
        self.done_seqs, self.cancelled, self.workers = 0, False, 0

    def run(self, progress: Optional[ProgressFn]) -> dict:
        live = self.engine._live()
        self.workers = len(live)
        for s in live:
            threading.Thread(target=self._work, args=(s,), daemon=True).start()
        reported = 0
        try:
            while True:
                with self.cond:
                    self.cond.wait(timeout=0.5)
                    error, remaining, done = self.error, self.remaining, self.done_seqs
                if error is not None:
                    raise error
                if progress is not None:
                    progress(done - reported)  # 0 between parts: the caller's chance to stop the call
                    reported = done
                if remaining == 0:
                    return self.results
        except BaseException:
            with self.cond:
                self.cancelled = True
                self.cond.notify_all()
            raise

    def _work(self, s: _Service) -> None:
        while True:
            with self.cond:
                while not self.queue and self.remaining and self.error is None and not self.cancelled:
                    self.cond.wait()
                if not self.queue or self.error is not None or self.cancelled:
                    return
                part = self.queue.popleft()
            try:
                groups = self.engine.generate_part(s, self.body(part), self.n)
            except _Down as exc:
                self._lost(s, part, str(exc))
                return
            except BaseException as exc:  # noqa: BLE001 - a refusal (or a bug) ends the call, in the caller
                with self.cond:
                    self.error = self.error or exc
                    self.cond.notify_all()
                return
            with self.cond:
                self.results[id(part)] = groups
                self.remaining -= 1
                self.done_seqs += len(groups) * self.n
                self.cond.notify_all()

    def _lost(self, s: _Service, part: _Part, why: str) -> None:
        """``s`` failed on ``part``: it leaves the call; the part goes back to the queue (if retries allow)."""
        s.alive, s.failure = False, why
        with self.cond:
            self.workers -= 1
            part.failed_on.append(s.url)
            if len(part.failed_on) > self.engine.retries:
                self.error = RemoteUnavailable(f"prompts {part.start}..{part.stop - 1} failed on "
                                               f"{len(part.failed_on)} services ({', '.join(part.failed_on)}; "
                                               f"rollout.remote.retries={self.engine.retries}); last: {why}. "
                                               f"{RESUME_HINT}")
            elif self.workers == 0:
                self.error = RemoteUnavailable("no rollout service is left: " + "; ".join(
                    f"{x.url} ({x.failure})" for x in self.engine.services) + f". {RESUME_HINT}")
            else:
                self.queue.appendleft(part)
            self.cond.notify_all()
