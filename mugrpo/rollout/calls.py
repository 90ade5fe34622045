"""Calls into user code (environment steps and closes, tool calls) run concurrently, bounded, timed.

One runner serves every such call: :class:`CallRunner`. It runs at most ``max_workers`` calls at
once, across every :meth:`CallRunner.run` made on it (the tool environments of a process share one,
:data:`TOOL_RUNNER`; the multi-turn loop makes one per stage for its environment steps), and gives
each call ``timeout_s`` from the moment it STARTS (waiting for a free slot does not count: a call
is timed on its own work, not on how busy the others keep the runner). A call past its time is
abandoned and gives its slot back at once: its thread cannot be killed (Python has no thread
cancellation), so it runs on unobserved as a daemon thread, which never blocks the process from
exiting (a ``ThreadPoolExecutor`` would join a hung worker at exit).

Results come back by index as :class:`CallResult`, whatever order the calls finish in, so the
caller's state does not depend on thread timing. Every failure is reported, none escapes: an
exception becomes ``error`` (its formatted traceback) and ``exception``. This module knows nothing
about environments, tools or tokens.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["CallResult", "CallRunner", "TOOL_RUNNER", "run_calls"]


@dataclass
class CallResult:
    value: Any = None
    error: Optional[str] = None
    """The formatted exception, when the call raised."""
    exception: Optional[BaseException] = None
    """The exception itself, when the call raised."""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class _Call:
    """One call's state, shared by its thread and the waiter (under the run's condition)."""

    __slots__ = ("started", "holding", "abandoned", "result")

    def __init__(self):
        self.started: Optional[float] = None
        self.holding = self.abandoned = False
        self.result: Optional[CallResult] = None


class CallRunner:
    """Runs calls on daemon threads, at most ``max_workers`` at once (see the module docstring)."""

    def __init__(self, max_workers: int):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._slots = threading.Semaphore(max_workers)

    def run(self, calls: list[Callable[[], Any]], timeout_s: float, name: str = "mugrpo-call") -> list[CallResult]:
        """Run ``calls`` concurrently; result i is call i's value, error or timeout."""
        cond = threading.Condition()
        states = [_Call() for _ in calls]
        for i, call in enumerate(calls):
            threading.Thread(target=self._work, args=(call, states[i], cond), daemon=True,
                             name=f"{name}-{i}").start()
        with cond:
            while True:
                now = time.monotonic()
                for st in states:
                    if st.result is None and st.started is not None and now - st.started >= timeout_s:
                        st.abandoned, st.result = True, CallResult(timed_out=True)
                        self._release(st)
                running = [st.started + timeout_s - now for st in states if st.result is None and st.started]
                if all(st.result is not None for st in states):
                    return [st.result for st in states]  # type: ignore[misc]
                cond.wait(max(0.0, min(running)) if running else None)

    def _work(self, call: Callable[[], Any], st: _Call, cond: threading.Condition) -> None:
        self._slots.acquire()
        with cond:
            st.started, st.holding = time.monotonic(), True
            cond.notify_all()
        try:
            result = CallResult(value=call())
        except BaseException as exc:  # noqa: BLE001 - user code: every failure is reported, none escapes
            result = CallResult(error=traceback.format_exc(limit=8), exception=exc)
        with cond:
            self._release(st)
            if not st.abandoned:
                st.result = result
            cond.notify_all()

    def _release(self, st: _Call) -> None:
        """Give the call's slot back, once (at its end or when it is abandoned); under the condition."""
        if st.holding:
            st.holding = False
            self._slots.release()


TOOL_RUNNER = CallRunner(16)
"""The runner tool environments share unless given their own."""


def run_calls(calls: list[Callable[[], Any]], max_workers: int, timeout_s: float) -> list[CallResult]:
    """Run ``calls`` on a runner of their own, at most ``max_workers`` at a time."""
    return CallRunner(max_workers).run(calls, timeout_s)
