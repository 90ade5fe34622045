"""Which service generates what, and what happens when one fails: the remote engine's dispatcher.

Everything here runs on the engine's event loop (one thread), so the services' states need no lock.

**Dynamic dispatch.** A ``generate`` call is cut into chunks (:mod:`.engine` decides their shape); each
chunk goes to the live service with the fewest requests in flight, below ``max_in_flight`` per service,
as soon as one is free. A slow service therefore takes fewer chunks instead of setting the pace; several
calls at once (stages generated ahead, evaluations, trajectories) share the same bound.

**Watching.** While a service has requests in flight, its ``/info`` is asked every ``poll_s``: no answer
within ``timeout_s``, a new ``boot_id`` (a restart), ``since_progress_s`` past ``stall_timeout_s`` (a
stuck engine behind a live server), or weights this trainer did not push (another trainer) and it
leaves. Its requests in flight are dropped and their chunks go back to be placed again (at most
``retries`` moves per chunk); one line on stderr names the service, why, and what moved.

**Coming back.** A service that left is asked ``/info`` in the background every ``probe_s``, never in a
call's way, so a frozen service costs one timeout, not one per call. Once it answers (and is not stuck)
it gets the current weights, if it lacks them, before its next chunk. A restarted service is taken back
the same way at once.

This module knows nothing about the shape of a chunk's request or answer (the caller's ``send``), the
weights file, or threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from mugrpo.rollout.engines.remote.wire import (BOOT_HEADER, VERSION_HEADER, Down, Http, RemoteUnavailable,
                                                ServiceRefused)

RESUME_HINT = ("once a service answers again (mugrpo serve ...), continue the run with: mugrpo train --resume "
               "RUN_DIR (the stage in flight is generated again)")

LIVE, DOWN, BACK = "live", "down", "back"
"""A service's states: in use; left (asked /info in the background); answering again (gets the weights,
then live)."""


@dataclass
class Service:
    url: str
    boot_id: str
    engine: str
    """``hf`` or ``vllm``, as its /info says."""
    model: str
    """The model name it serves (the ``model`` field of its requests)."""
    max_in_flight: int
    state: str = LIVE
    failure: str = ""
    """Why it last left (for the error when none is left)."""
    in_flight: int = 0
    num_chunks: int = 0
    """Chunks it answered (``perf/remote_chunks/...``)."""
    num_failures: int = 0
    """Times it left (each printed one failover line)."""
    chunks: set = field(default_factory=set)
    """The chunks it holds now (named in the failover line)."""
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when it leaves: its requests in flight stop waiting (a new one per stay)."""
    refusal: Optional[ServiceRefused] = None
    """A refusal its watcher saw, raised by the next call that places a chunk."""
    refused: bool = False
    """It refused (e.g. another trainer's weights): left out for good."""
    watcher: Optional[asyncio.Task] = None
    prober: Optional[asyncio.Task] = None

    @property
    def alive(self) -> bool:
        return self.state == LIVE


@dataclass(eq=False)  # compared and hashed by identity: two calls may hold chunks of the same range
class Chunk:
    """Prompts ``start:stop`` of one call; ``failed_on``: the services it failed on so far."""

    start: int
    stop: int
    failed_on: list = field(default_factory=list)

    def __str__(self):
        return f"{self.start}..{self.stop - 1}"


@dataclass
class Limits:
    timeout_s: float
    stall_timeout_s: float
    retries: int
    poll_s: float
    probe_s: float


Send = Callable[[Service, Chunk], Awaitable[tuple[dict, object]]]
"""Sends one chunk to one service; returns the answer's JSON and headers (raises Down / ServiceRefused)."""


class Left(Down):
    """A request dropped because its service left (for a failure seen elsewhere: a restart, another
    request's failure, its watcher)."""


class Dispatcher:
    """The services of one engine and the weights version they must hold (``version``, ``weights_file``:
    the file's name in the services' ``--weights-dir``). A service never goes back to a lower version, so
    this engine's versions continue from the highest one its services held at start (``version``, with
    ``weights_file`` None until the first load)."""

    def __init__(self, http: Http, services: list[Service], limits: Limits, version: int = 0):
        self.http, self.services, self.limits = http, services, limits
        self.version, self.weights_file = version, None
        self.loading = False
        self._weights_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._tasks: set = set()
        self.closed = False

    # -- placing chunks --------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _no_service_left(self) -> RemoteUnavailable:
        return RemoteUnavailable("no rollout service is left: " + "; ".join(
            f"{s.url} ({s.failure})" for s in self.services) + f". {RESUME_HINT}")

    async def _acquire(self) -> Service:
        """The live service with the fewest requests in flight below its bound (waits for one)."""
        while True:
            for s in self.services:
                if s.refusal is not None:
                    refusal, s.refusal = s.refusal, None
                    raise refusal
            changed = self._changed
            free = [s for s in self.services if s.alive and s.in_flight < s.max_in_flight]
            if free:
                return min(free, key=lambda s: s.in_flight)
            back = [s for s in self.services if s.state == BACK]
            if back and not any(s.alive for s in self.services):
                await asyncio.gather(*(self.rejoin(s) for s in back))
                continue
            if not any(s.alive for s in self.services) and not back:
                raise self._no_service_left()
            await changed.wait()

    @contextlib.contextmanager
    def _busy(self, s: Service, chunk: Optional[Chunk] = None):
        s.in_flight += 1
        if chunk is not None:
            s.chunks.add(chunk)
        if s.watcher is None or s.watcher.done():
            s.watcher = asyncio.get_running_loop().create_task(self._watch(s))
        try:
            yield
        finally:
            s.in_flight -= 1
            s.chunks.discard(chunk)
            self._notify()

    async def _exchange(self, s: Service, request: Awaitable):
        """Await ``request`` unless ``s`` leaves first (then Down, or its refusal)."""
        gone = s.gone
        task = asyncio.ensure_future(request)
        waiter = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, waiter):
                if not t.done():
                    t.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        if s.refusal is not None:
            refusal, s.refusal = s.refusal, None
            raise refusal
        raise Left(s.failure)

    async def run_chunk(self, chunk: Chunk, send: Send, check: Callable[[Service, dict], object]):
        """Place ``chunk`` until a service answers it; ``check(service, answer)`` builds the result
        (ValueError: malformed, refused naming the URL)."""
        while True:
            s = await self._acquire()
            with self._busy(s, chunk):  # the chunk counts as in flight on s until the failover line names it
                try:
                    answer, headers = await self._exchange(s, send(s, chunk))
                    self._check_headers(s, headers)
                    failure = None
                except Down as exc:
                    if not isinstance(exc, Left):  # this request failed: the service leaves (if it has not yet)
                        self.leave(s, str(exc), DOWN)
                    failure = exc
            if failure is not None:
                exc = failure
                chunk.failed_on.append(s.url)
                if len(chunk.failed_on) > self.limits.retries:
                    raise RemoteUnavailable(
                        f"prompts {chunk} failed on {len(chunk.failed_on)} services ({', '.join(chunk.failed_on)}; "
                        f"rollout.remote.retries={self.limits.retries}); last: {exc}. {RESUME_HINT}") from None
                continue
            try:
                result = check(s, answer)
            except ValueError as exc:
                raise ServiceRefused(f"the rollout service at {s.url} answered /v1/completions with a malformed "
                                     f"result: {exc}; refused") from None
            s.num_chunks += 1
            return result

    def _check_headers(self, s: Service, headers) -> None:
        """The answer came from this boot of ``s`` (else: restarted, Down) and this weights version."""
        boot, version = headers.get(BOOT_HEADER), headers.get(VERSION_HEADER)
        if boot is None or version is None:
            raise ServiceRefused(f"the rollout service at {s.url} answered without the {BOOT_HEADER} and "
                                 f"{VERSION_HEADER} headers; is that URL a mugrpo serve service?")
        if boot != s.boot_id:
            self.leave(s, f"{s.url} restarted before it answered", BACK)
            raise Left(f"{s.url} restarted before it answered")
        if version != str(self.version):
            refusal = self._other_trainer(s, version, None)
            self._refuse(s, refusal)
            s.refusal = None  # raised here
            raise refusal

    def _other_trainer(self, s: Service, version, file) -> ServiceRefused:
        theirs = f"{version}" + (f" ({file})" if file else "")
        ours = f"{self.version}" + (f" ({self.weights_file})" if self.weights_file else "")
        return ServiceRefused(f"the rollout service at {s.url} holds weights version {theirs}, not this trainer's "
                              f"version {ours}: is another trainer using it? Give each trainer its own services")

    # -- leaving, watching, coming back ----------------------------------------------------------------

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a reference, so the task is not collected before it ends
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, s: Service, exc: ServiceRefused) -> None:
        """``s`` refused (or holds weights this trainer did not push): out for good; the next call raises it."""
        s.refusal, s.refused = exc, True
        self.leave(s, str(exc), DOWN)
        if s.state != DOWN:  # it was BACK: leave() took it anyway; LIVE cannot stay
            s.state = DOWN
        self._notify()

    def leave(self, s: Service, why: str, state: str) -> None:
        """``s`` leaves (``DOWN``: probed in the background; ``BACK``: it answers, rejoin before use); its
        requests in flight stop; one line says what moved. A second call for one failure does nothing."""
        if s.state == DOWN or (s.state == BACK and state == BACK):
            return
        moved = sorted(s.chunks, key=lambda c: c.start)
        s.state, s.failure = state, why
        s.num_failures += 1
        s.gone.set()
        others = [x.url for x in self.services if x.alive]
        what = (f"its {len(moved)} request(s) in flight (prompts {', '.join(map(str, moved))}) go to "
                f"{', '.join(others) or 'no other service: none is left'}") if moved else "nothing was in flight"
        after = ("it gets the current weights before its next use" if state == BACK else "it is not used again"
                 if s.refused else f"it is asked /info every {self.limits.probe_s:g} s and used again once it answers")
        print(f"[mugrpo] rollout service {s.url} left out: {why}; {what}; {after}", file=sys.stderr, flush=True)
        if state == DOWN and not s.refused and (s.prober is None or s.prober.done()):
            s.prober = asyncio.get_running_loop().create_task(self._probe(s))
        elif state == BACK:
            self._background(self.rejoin(s))
        self._notify()

    def stuck(self, s: Service, info: dict) -> str:
        """Why ``s`` is taken as stuck ("" if it is not): its engine has held a generate request without a
        decode step for longer than ``rollout.remote.stall_timeout_s``."""
        since = info.get("since_progress_s")
        if isinstance(since, (int, float)) and since > self.limits.stall_timeout_s:
            return (f"{s.url} answers, but its engine made no progress for {since:.0f} s on a generate request "
                    f"(rollout.remote.stall_timeout_s={self.limits.stall_timeout_s:g}); is it stuck? Restart it")
        return ""

    async def _watch(self, s: Service) -> None:
        """Ask ``s``'s /info every ``poll_s`` while it has requests in flight (module docstring)."""
        while s.in_flight and s.state != DOWN and not self.closed:
            await asyncio.sleep(self.limits.poll_s)
            if not s.in_flight or s.state == DOWN:
                return
            try:
                info, _ = await self.http.request(s.url, "/info")
            except Down as exc:
                self.leave(s, f"{s.url} stopped answering /info while it worked ({exc})", DOWN)
                return
            except ServiceRefused as exc:
                self._refuse(s, exc)
                return
            if str(info.get("boot_id")) != s.boot_id:
                self.leave(s, f"{s.url} restarted while it worked", BACK)
                return
            why = self.stuck(s, info)
            if why:
                self.leave(s, why, DOWN)
                return
            held = (info.get("weights_version"), info.get("weights_file"))
            if s.alive and not self.loading and self.weights_file and held != (self.version, self.weights_file):
                self._refuse(s, self._other_trainer(s, *held))
                return

    async def _probe(self, s: Service) -> None:
        """Ask a service that left /info every ``probe_s`` until it answers, not stuck; then rejoin it."""
        while s.state == DOWN and not self.closed:
            await asyncio.sleep(self.limits.probe_s)
            try:
                info, _ = await self.http.request(s.url, "/info")
            except (Down, ServiceRefused):
                continue
            if self.stuck(s, info):
                continue
            s.state = BACK
            await self.rejoin(s)
            return

    async def rejoin(self, s: Service) -> None:
        """Give a service that answers again the current weights (unless it holds them), then use it."""
        async with self._weights_lock:
            if s.state != BACK:
                return
            try:
                info, _ = await self.http.request(s.url, "/info")
                s.boot_id, s.gone = str(info.get("boot_id")), asyncio.Event()
                if self.weights_file and (info.get("weights_version"), info.get("weights_file")) != (
                        self.version, self.weights_file):
                    await self._push(s)
            except Down as exc:
                self.leave(s, f"{s.url} failed while it rejoined ({exc})", DOWN)
                return
            except ServiceRefused as exc:
                self._refuse(s, exc)
                return
            s.state = LIVE
            print(f"[mugrpo] rollout service {s.url} answers again and holds weights version {self.version}: "
                  "back in use", file=sys.stderr, flush=True)
            self._notify()

    # -- weights ---------------------------------------------------------------------------------------

    async def _push(self, s: Service) -> None:
        """Have ``s`` load ``weights_file`` as ``version``; raises Down (it is gone) or ServiceRefused.
        A refusal of a version it already holds (another rank of this trainer pushed it) is no error."""
        body = {"path": self.weights_file, "version": self.version}
        with self._busy(s):
            try:
                answer, _ = await self._exchange(s, self.http.request(s.url, "/load_weights", body, long=True))
            except ServiceRefused as exc:
                info, _ = await self.http.request(s.url, "/info")
                if (info.get("weights_version"), info.get("weights_file")) == (self.version, self.weights_file):
                    return
                raise ServiceRefused(f"{exc} (is rollout.remote.weights_dir the service's --weights-dir?)") from None
        if answer.get("weights_version") != self.version:
            raise ServiceRefused(f"the rollout service at {s.url} reports weights version "
                                 f"{answer.get('weights_version')!r} after loading version {self.version}")
        s.boot_id = str(answer.get("boot_id", s.boot_id))

    async def load(self, version: int, weights_file: str) -> None:
        """Every service that answers loads ``weights_file`` as ``version``; one that fails leaves; a
        refusal is raised once every push has ended; no service left: RemoteUnavailable."""
        async with self._weights_lock:
            self.version, self.weights_file, self.loading = version, weights_file, True
            try:
                targets = [s for s in self.services if s.alive]  # one that is BACK rejoins on its own, after
                results = await asyncio.gather(*(self._push(s) for s in targets), return_exceptions=True)
            finally:
                self.loading = False
        refusal = None
        for s, result in zip(targets, results):
            if isinstance(result, Down):
                self.leave(s, f"{s.url} failed while it loaded weights version {version} ({result})", DOWN)
            elif isinstance(result, BaseException):
                refusal = refusal or result
        self._notify()
        if refusal is not None:
            raise refusal
        if not any(s.state in (LIVE, BACK) for s in self.services):  # one that is BACK gets this version next
            raise self._no_service_left()

    async def await_version(self, version: int) -> None:
        """Ranks > 0: wait until every live service reports ``version`` (rank 0 writes and pushes it)."""
        self.version = version
        for s in [s for s in self.services if s.alive]:
            deadline = time.monotonic() + 20 * self.limits.timeout_s
            while True:
                try:
                    info, _ = await self.http.request(s.url, "/info")
                except Down as exc:
                    self.leave(s, f"{s.url} stopped answering /info ({exc})", DOWN)
                    break
                if info.get("weights_version") == version:
                    s.boot_id, self.weights_file = str(info.get("boot_id")), info.get("weights_file")
                    break
                if time.monotonic() > deadline:
                    raise RemoteUnavailable(f"the rollout service at {s.url} did not reach weights version "
                                            f"{version} (rank 0 writes it) within {20 * self.limits.timeout_s:g} s")
                await asyncio.sleep(self.limits.poll_s)
        if not any(s.alive for s in self.services):
            raise self._no_service_left()

    async def close(self) -> None:
        self.closed = True
        for s in self.services:
            for task in (s.watcher, s.prober):
                if task is not None and not task.done():
                    task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.http.close()
