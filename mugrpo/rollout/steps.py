"""Calls into user code (environment steps, resets, closes) run concurrently, bounded, with a timeout.

One slow environment must not serialise a stage: the multi-turn loop hands every active
trajectory's ``env.step`` to :func:`run_calls`, which runs at most ``max_workers`` at a time on
daemon threads and gives each call ``timeout_s`` from the moment it starts. A call past its time is
abandoned: its thread cannot be killed (Python has no thread cancellation), so it runs on
unobserved, no longer counted against the bound, and a daemon thread never blocks the process
from exiting (a ``ThreadPoolExecutor`` would join a hung worker at exit).

Results come back by index, whatever order the calls finish in, so the caller's state does not
depend on thread timing. This module knows nothing about environments or tokens.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class CallResult:
    value: Any = None
    error: str | None = None
    """The formatted exception, when the call raised."""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def run_calls(calls: list[Callable[[], Any]], max_workers: int, timeout_s: float) -> list[CallResult]:
    """Run ``calls`` at most ``max_workers`` at a time; result i is call i's value, error or timeout."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    results: list[CallResult | None] = [None] * len(calls)
    done: queue.Queue = queue.Queue()
    started: dict[int, float] = {}  # running calls: index -> start time
    upcoming = iter(range(len(calls)))

    def worker(i: int) -> None:
        try:
            done.put((i, CallResult(value=calls[i]())))
        except BaseException:  # noqa: BLE001 - user code: every failure is reported, none escapes
            done.put((i, CallResult(error=traceback.format_exc(limit=8))))

    def launch() -> None:
        while len(started) < max_workers:
            i = next(upcoming, None)
            if i is None:
                return
            started[i] = time.monotonic()
            threading.Thread(target=worker, args=(i,), daemon=True, name=f"mugrpo-call-{i}").start()

    launch()
    while started:
        wait = max(0.0, min(started.values()) + timeout_s - time.monotonic())
        try:
            i, result = done.get(timeout=wait)
            if i in started:  # else: already given up on; its late result is dropped
                del started[i]
                results[i] = result
        except queue.Empty:
            now = time.monotonic()
            for i in [i for i, t in started.items() if now - t >= timeout_s]:
                del started[i]
                results[i] = CallResult(timed_out=True)
        launch()
    return results  # type: ignore[return-value]
