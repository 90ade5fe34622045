"""Independent trajectories: each multi-turn trajectory sends its next turn as soon as its environment
step returns, so tools and generation overlap across the trajectories of a stage.

The lock-step loop (:mod:`mugrpo.rollout.multiturn`) sends every active trajectory's turn in one engine
call, then runs every environment step, then the next turn: the engine waits for the slowest tool of the
turn, and every tool for the slowest generation. Here (as verl's agent loop, prime-rl with verifiers and
SkyRL run them) a trajectory is on its own: when its request is answered its environment steps; when the
step returns its next request is sent. It needs an engine that serves concurrent ``generate`` calls and
batches them (``engine.concurrent``: the remote engine on vLLM's server); an in-process engine serves one
call at a time and runs lock-step (:attr:`mugrpo.rollout.multiturn.LoopContext.independent`).

Requests. Turn 0 is one request per group: its prompt with n = G (the prompt prefilled once). A later
turn is one request per trajectory: its ids so far, n = 1. Each request's seed derives from the stage's
sampling seed and its position alone: ``derive(seed, "multiturn-group", g)`` for group g's first turn,
``derive(seed, "multiturn-trajectory", i, k)`` for trajectory i's turn k. What a request samples therefore
does not depend on which trajectory finished first, on ``env.max_inflight``, nor on what else is in
flight where the engine answers each request on its own (the HF service); vLLM batches requests together
and is not bitwise in any mode. The seeds differ from the lock-step loop's (one per turn), so the two
modes give different, equally valid samples.

Bounds and order. At most ``limits.max_inflight`` requests are in flight; the others wait in the order
they became ready. Environment steps run on one :class:`mugrpo.rollout.calls.CallRunner` per loop: at
most ``limits.max_workers`` at once, each timed from its start (``limits.step_timeout_s``), as in
lock-step. Every trajectory's state is changed by the loop's own thread only (the requests' and steps'
threads hand their results back through a queue), and each trajectory keeps its index, so the stage's
data comes out in trajectory order, and the same, whatever order the results arrive in.

Stopping. ``progress(n)`` is called on the loop's thread with the trajectories just ended, and with 0 at
least every :data:`HEARTBEAT_S`; an exception raised from it (or from a request) stops the loop: requests
in flight are stopped at their next heartbeat, steps in flight are waited for (each bounded by its
timeout), then the exception propagates. No thread of the loop outlives it but an abandoned step, as in
lock-step.

This module knows nothing about rewards, advantages or the loss; the per-trajectory bookkeeping (what a
turn appends, how a step ends a trajectory) is :mod:`mugrpo.rollout.multiturn`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

from mugrpo.faults import maybe_die
from mugrpo.rollout.calls import CallResult, CallRunner
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.multiturn import (LoopContext, Trajectory, settle_step, share_out, step_call,
                                      take_policy_turn, turn_cap)
from mugrpo.seeds import derive

HEARTBEAT_S = 0.25
"""The loop calls ``progress(0)`` at least this often, so that a stop lands within about this long."""


class Stopped(Exception):
    """Raised inside a request's engine call (from its progress callback) when the loop stops."""


@dataclass(frozen=True)
class Request:
    """One ``generate`` call: a group's first turn (n = G) or one trajectory's later turn (n = 1)."""

    members: tuple[int, ...]
    """The trajectories it answers, in order (a group's G, or one)."""
    prompt: list[int]
    sampling: SamplingConfig
    cap: int


class Occupancy:
    """What is in flight, over wall-clock time: generation requests and environment steps (thread-safe).

    ``busy_s``: seconds with at least one request in flight (the engine worked). ``tool_wait_s``: seconds
    with a step running and no request in flight (the engine waited for tools). A step is *overlapped*
    when a request was in flight at some moment while it ran."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = self.steps = 0
        self.busy_s = self.tool_wait_s = 0.0
        self._since = time.perf_counter()
        self._running: dict[int, bool] = {}
        """Trajectory index of each running step -> did a request overlap it so far."""

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.requests:
            self.busy_s += now - self._since
        elif self.steps:
            self.tool_wait_s += now - self._since
        self._since = now

    def request_started(self) -> None:
        with self._lock:
            self._tick()
            self.requests += 1
            self._running = dict.fromkeys(self._running, True)

    def request_ended(self) -> None:
        with self._lock:
            self._tick()
            self.requests -= 1

    def step_started(self, i: int) -> None:
        with self._lock:
            self._tick()
            self.steps += 1
            self._running[i] = self.requests > 0

    def step_ended(self, i: int) -> bool:
        """Whether the step overlapped a request."""
        with self._lock:
            self._tick()
            self.steps -= 1
            return self._running.pop(i)

    def close(self) -> None:
        with self._lock:
            self._tick()


def run_independent(ctx: LoopContext, trajs: list[Trajectory], G: int, sampling: SamplingConfig,
                    progress: Optional[Callable[[int], None]] = None) -> float:
    """Roll out ``trajs`` (G per group, group-major, environments reset) each on its own; returns the
    seconds with a request in flight. ``sampling`` carries the stage's seed and the shared stop strings.
    Adds to each trajectory's metadata ``step_wait_s`` (its share of the loop's tool wait, once a step
    ran) and ``num_overlapped_steps``."""
    loop = _Loop(ctx, trajs, sampling)
    occupancy = loop.occupancy
    try:
        loop.run([loop.first_request(g, G) for g in range(len(trajs) // G)], progress)
    finally:
        occupancy.close()
    if loop.num_steps:  # as lock-step: a loop that stepped no environment reports no wait
        share_out(trajs, "step_wait_s", occupancy.tool_wait_s)
    return occupancy.busy_s


class _Loop:
    """The loop's state; every field is read and written by the loop's thread only (``events`` and the
    occupancy aside, which the request and step threads share)."""

    def __init__(self, ctx: LoopContext, trajs: list[Trajectory], sampling: SamplingConfig):
        self.ctx, self.trajs, self.sampling, self.limits = ctx, trajs, sampling, ctx.limits
        self.eos = ctx.eos_ids()
        self.events: queue.Queue = queue.Queue()
        self.runner = CallRunner(self.limits.max_workers)
        self.occupancy = Occupancy()
        self.stopping = threading.Event()
        self.in_flight = self.stepping = self.num_steps = 0

    # -- requests ---------------------------------------------------------------------------------------

    def first_request(self, g: int, G: int) -> Request:
        head = self.trajs[g * G]
        return Request(tuple(range(g * G, (g + 1) * G)), head.prompt_ids,
                       dataclasses.replace(self.sampling, n=G, seed=derive(self.sampling.seed, "multiturn-group", g)),
                       turn_cap(head, self.sampling, self.limits))

    def next_request(self, i: int) -> Request:
        t = self.trajs[i]
        seed = derive(self.sampling.seed, "multiturn-trajectory", i, t.num_turns)
        return Request((i,), t.prompt_ids + t.response_ids, dataclasses.replace(self.sampling, n=1, seed=seed),
                       turn_cap(t, self.sampling, self.limits))

    def _send(self, request: Request) -> None:
        self.occupancy.request_started()
        _start(self._generate, request, "mugrpo-turn", self.occupancy.request_ended)
        self.in_flight += 1

    def _generate(self, request: Request) -> None:
        try:
            [group] = self.ctx.engine.generate([request.prompt], request.sampling, progress=self._beat,
                                               max_new_tokens=[request.cap])
            event = ("generated", request, list(group), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread, which raises it
            event = ("generated", request, None, exc)
        self.occupancy.request_ended()
        self.events.put(event)

    def _beat(self, n: int) -> None:
        """The engine's progress callback inside a request: the loop's chance to stop it."""
        if self.stopping.is_set():
            raise Stopped("the trajectory loop stopped")

    # -- environment steps ------------------------------------------------------------------------------

    def _step(self, i: int) -> None:
        self.occupancy.step_started(i)
        _start(self._run_step, i, "mugrpo-step", lambda: self.occupancy.step_ended(i))
        self.stepping += 1
        self.num_steps += 1

    def _run_step(self, i: int) -> None:
        try:
            [result] = self.runner.run([step_call(self.trajs[i])], self.limits.step_timeout_s)
        except BaseException as exc:  # noqa: BLE001 - the runner itself failed (no thread): the step's error
            result = CallResult(error=traceback.format_exc(limit=8), exception=exc)
        overlapped = self.occupancy.step_ended(i)
        self.events.put(("stepped", i, result, overlapped))

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, first: list[Request], progress: Optional[Callable[[int], None]]) -> None:
        ready = collections.deque(first)
        last_beat = time.monotonic()
        try:
            while ready or self.in_flight or self.stepping:
                while ready and self.in_flight < self.limits.max_inflight:
                    self._send(ready.popleft())
                if time.monotonic() - last_beat >= HEARTBEAT_S:
                    last_beat = time.monotonic()
                    if progress is not None:
                        progress(0)
                try:
                    event = self.events.get(timeout=max(0.0, last_beat + HEARTBEAT_S - time.monotonic()))
                except queue.Empty:
                    continue
                ended = self._handle(event, ready)
                if progress is not None and ended:
                    progress(ended)
                    last_beat = time.monotonic()
        except BaseException:
            self.stopping.set()
            self._drain()
            raise

    def _handle(self, event: tuple, ready: collections.deque) -> int:
        """Take one result; the number of trajectories it ended."""
        ended = 0
        if event[0] == "generated":
            _, request, group, error = event
            self.in_flight -= 1
            if error is not None:
                raise error
            for i, completion in zip(request.members, group, strict=True):
                ended += self._take_turn(i, completion)
            maybe_die("turn")
        else:
            _, i, result, overlapped = event
            self.stepping -= 1
            t = self.trajs[i]
            t.metadata["num_overlapped_steps"] = t.metadata.get("num_overlapped_steps", 0.0) + float(overlapped)
            settle_step(t, result, self.limits, self.ctx.env_turn_ids, self.eos)
            if t.active:
                ready.append(self.next_request(i))
            else:
                ended += 1
        return ended

    def _take_turn(self, i: int, completion: Completion) -> int:
        """Append trajectory i's policy turn; step its environment, or count it ended (1)."""
        t = self.trajs[i]
        if take_policy_turn(t, completion, t.num_turns, self.ctx.text):
            self._step(i)
            return 0
        return 1

    def _drain(self) -> None:
        """Wait for every request (stopped at its next heartbeat) and step (bounded by its timeout) in
        flight, dropping their results, so that nothing of the loop runs on after it."""
        while self.in_flight or self.stepping:
            kind = self.events.get()[0]
            if kind == "generated":
                self.in_flight -= 1
            else:
                self.stepping -= 1


def _start(target: Callable, arg, name: str, undo: Callable[[], object]) -> None:
    """Run ``target(arg)`` on a daemon thread; if the thread cannot start, ``undo`` and raise (nothing was
    put in flight, so the loop's drain does not wait for it)."""
    try:
        threading.Thread(target=target, args=(arg,), daemon=True, name=name).start()
    except BaseException:
        undo()
        raise
