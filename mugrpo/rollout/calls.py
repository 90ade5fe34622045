"""Calls into user code (environment construction, resets, steps, metrics and closes, tool calls)
run concurrently, bounded, timed.

One runner serves every such call: :class:`CallRunner`. It runs at most ``max_workers`` calls at
once, across every :meth:`CallRunner.run` made on it (the tool environments of a process share one,
:data:`TOOL_RUNNER`; the multi-turn loop makes one per stage for its environment steps), and gives
each call ``timeout_s`` from the moment it STARTS (waiting for a free slot does not count: a call
is timed on its own work, not on how busy the others keep the runner). A call past its time is
abandoned and gives its slot back at once.

Two isolations:

- ``process`` (what a run uses for user code by default, ``env.step_isolation`` /
  ``env.tool_isolation``): the call (it must pickle: a module-level function and plain arguments)
  runs in a worker process (``spawn``), reused from call to call. At its timeout the worker is
  killed and a fresh one replaces it on the next call, so even a call holding the GIL (a
  catastrophic regex) ends on time; a worker that dies (``os._exit``, a crash) is a
  :class:`ProcessExit`, and the next call gets a fresh worker. It costs a pickle round trip per call
  and a worker start after each timeout (``benchmarks/call_isolation.py``, docs/ENVIRONMENTS.md).
- ``thread`` (this class's default, for mugrpo's own bounded calls, and the opt-in for speed): the
  call runs on a daemon thread. A thread cannot be killed (Python has no thread cancellation), so an
  abandoned call runs on unobserved; it never blocks the process from exiting (a
  ``ThreadPoolExecutor`` would join a hung worker at exit). Abandoned threads still running are
  capped process-wide (:data:`MAX_ABANDONED`): past the cap a new call is refused at once
  (``refused``, an error like any other) instead of adding one more thread, so hung user code cannot
  pile up threads over a long run. A call that holds the GIL also stalls every other thread until it
  returns: use ``process``. While a call runs on its thread, ``os._exit`` called on that thread
  raises :class:`ProcessExit` instead of ending the process (:func:`_guard_process_exit`); a crash in
  native code, or an ``_exit`` bound before the guard (``from os import _exit``), still ends it.

Results come back by index as :class:`CallResult`, whatever order the calls finish in, so the
caller's state does not depend on thread timing. Every failure is reported, none escapes: an
exception becomes ``error`` (its formatted traceback) and ``exception``; a process exit also sets
``exited`` (the exit code). This module knows nothing
about environments, tools or tokens.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["CallResult", "CallRunner", "TOOL_RUNNER", "run_calls", "process_tool_runner", "MAX_ABANDONED",
           "ISOLATIONS", "abandoned_calls", "ProcessExit"]

ISOLATIONS = ("thread", "process")
MAX_ABANDONED = 64
"""Abandoned (timed-out, still running) call threads allowed in the process; past it, calls are refused."""
_abandoned = 0
WORKER_START_S = 120.0
"""How long a worker process may take to start and load a call (imports) before the call is an error."""
_abandoned_lock = threading.Lock()


def abandoned_calls() -> int:
    """Abandoned call threads still running in this process."""
    return _abandoned


class ProcessExit(Exception):
    """User code ended (or tried to end) its process: ``os._exit`` on a call's thread, or a worker
    process that died. ``code``: the exit code (negative: the signal that ended the worker)."""

    def __init__(self, message: str, code: Optional[int] = None):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # it travels back from a worker process with its code
        return ProcessExit, (str(self), self.code)


_guard = threading.local()
_guard_lock = threading.Lock()
_prev_exit: Callable[[int], None] = os._exit
_owner_pid = os.getpid()


def _guarded_exit(code: int) -> None:
    """``os._exit`` while the guard is installed (:func:`_guard_process_exit`)."""
    if os.getpid() == _owner_pid and getattr(_guard, "active", False):
        caller = sys._getframe(1).f_code
        raise ProcessExit(f"{caller.co_qualname} ({caller.co_filename}:{caller.co_firstlineno}) called os._exit({code}), "
                          "which would end the run without a message", code)
    _prev_exit(code)


def _guard_process_exit() -> None:
    """Mark this thread as running user code: ``os._exit`` called on it raises :class:`ProcessExit`
    (naming the function that called it) instead of ending the process. The guard is (re)installed
    over whatever ``os._exit`` is now (another guard, e.g. the rewards', restores its own when it
    ends); every other thread, and a forked child, gets the function it replaced."""
    global _prev_exit, _owner_pid
    with _guard_lock:
        if os._exit is not _guarded_exit:
            _prev_exit, _owner_pid, os._exit = os._exit, os.getpid(), _guarded_exit
    _guard.active = True


@dataclass
class CallResult:
    value: Any = None
    error: Optional[str] = None
    """The formatted exception, when the call raised (or was refused)."""
    exception: Optional[BaseException] = None
    """The exception itself, when the call raised."""
    timed_out: bool = False
    refused: bool = False
    """Not run: too many abandoned calls are still running (:data:`MAX_ABANDONED`)."""
    exited: Optional[int] = None
    """The exit code, when the call ended its process (:class:`ProcessExit`)."""

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
    """Runs calls on daemon threads (or worker processes), at most ``max_workers`` at once (see the
    module docstring)."""

    def __init__(self, max_workers: int, isolation: str = "thread"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        self.max_workers, self.isolation = max_workers, isolation
        self._slots = threading.Semaphore(max_workers)
        self._workers = _WorkerPool() if isolation == "process" else None

    def run(self, calls: list[Callable[[], Any]], timeout_s: float, name: str = "mugrpo-call") -> list[CallResult]:
        """Run ``calls`` concurrently; result i is call i's value, error, timeout or refusal."""
        cond = threading.Condition()
        states = [_Call() for _ in calls]
        for i, call in enumerate(calls):
            if _abandoned >= MAX_ABANDONED:
                states[i].result = _refusal()
                continue
            threading.Thread(target=self._work, args=(call, states[i], cond, timeout_s), daemon=True,
                             name=f"{name}-{i}").start()
        with cond:
            while True:
                now = time.monotonic()
                for st in states:
                    if st.result is None and st.started is not None and now - st.started >= timeout_s:
                        st.abandoned, st.result = True, CallResult(timed_out=True)
                        _count_abandoned(+1)
                        self._release(st)
                running = [st.started + timeout_s - now for st in states if st.result is None and st.started]
                if all(st.result is not None for st in states):
                    return [st.result for st in states]  # type: ignore[misc]
                cond.wait(max(0.0, min(running)) if running else None)

    def prestart(self, count: int, warm: Optional[Callable[[], Any]] = None) -> float:
        """``process`` isolation: start ``count`` idle workers now, each having run ``warm`` (a picklable
        call, e.g. importing the tools' modules), so that no call (nor the environment step around it,
        timed by ``env.step_timeout_s``) waits for a worker's start-up; a killed worker is replaced in
        the background. Returns the seconds it took (0 under ``thread``); raises when a worker fails to
        start within :data:`WORKER_START_S`."""
        if self._workers is None:
            return 0.0
        t0 = time.monotonic()
        self._workers.prestart(count, warm)
        return time.monotonic() - t0

    def _work(self, call: Callable[[], Any], st: _Call, cond: threading.Condition, timeout_s: float) -> None:
        self._slots.acquire()
        worker = None
        if self._workers is None:
            _guard_process_exit()
        try:
            # A worker's start and its unpickling of the call (imports: seconds under spawn) are not
            # the call's time: the clock starts when the worker says it has begun.
            worker = self._workers.begin(call) if self._workers is not None else None
            with cond:
                st.started, st.holding = time.monotonic(), True
                cond.notify_all()
            result = self._workers.finish(worker, timeout_s) if worker is not None else CallResult(value=call())
        except BaseException as exc:  # noqa: BLE001 - user code: every failure is reported, none escapes
            result = CallResult(error=traceback.format_exc(limit=8), exception=exc,
                                exited=exc.code if isinstance(exc, ProcessExit) else None)
            with cond:
                st.holding = st.holding or st.started is None  # a failed worker start still holds its slot
        with cond:
            self._release(st)
            if st.abandoned:
                _count_abandoned(-1)
            else:
                st.result = result
            cond.notify_all()

    def _release(self, st: _Call) -> None:
        """Give the call's slot back, once (at its end or when it is abandoned); under the condition."""
        if st.holding:
            st.holding = False
            self._slots.release()


def _count_abandoned(delta: int) -> None:
    global _abandoned
    with _abandoned_lock:
        _abandoned += delta


def _refusal() -> CallResult:
    message = (f"refused: {_abandoned} earlier calls timed out and are still running (at most {MAX_ABANDONED}); "
               "the user code hangs: fix it, or run it in worker processes (env.tool_isolation=process)")
    return CallResult(error=message, exception=RuntimeError(message), refused=True)


# ---------------------------------------------------------------------------------------------
# Worker processes (isolation="process").


def _noop() -> None:
    """The warm call of a prestarted worker with nothing to import."""


def _worker_main(conn) -> None:
    """A worker's loop: receive a pickled call, send back ("ok", value) or ("error", traceback, exc)."""
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        except BaseException as exc:  # noqa: BLE001 - the call did not unpickle here (an import failed)
            conn.send(("error", traceback.format_exc(limit=8), RuntimeError(f"{type(exc).__name__}: {exc}")))
            continue
        conn.send(("started", None, None))
        try:
            reply = ("ok", call(), None)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            reply = ("error", traceback.format_exc(limit=8), exc)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - an unpicklable value or exception: say so instead
            conn.send(("error", f"{type(exc).__name__}: {exc} (sending back {reply[0]} of {type(reply[1]).__name__})",
                       None))


class _WorkerPool:
    """Idle worker processes; a call takes one (or starts one), gives it back, or kills it at its timeout."""

    def __init__(self):
        self._idle: list = []
        self._lock = threading.Lock()
        self._ctx = multiprocessing.get_context("spawn")
        self._warm: Optional[Callable[[], Any]] = None
        """Set by :meth:`prestart`: then a killed worker is replaced at once, in the background."""

    def prestart(self, count: int, warm: Optional[Callable[[], Any]]) -> None:
        """Start workers (concurrently) until ``count`` are idle, each warmed by ``warm``; see
        :meth:`CallRunner.prestart`."""
        self._warm = warm or _noop
        with self._lock:
            missing = max(0, count - len(self._idle))
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._start_one, args=(errors,), daemon=True) for _ in range(missing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _start_one(self, errors: Optional[list] = None) -> None:
        """Start a worker, run the warm call in it, and put it with the idle ones."""
        try:
            proc, conn = self.begin(self._warm or _noop, new=True)
            result = self.finish((proc, conn), WORKER_START_S)
            if not result.ok:
                raise RuntimeError(f"a worker process did not start: {result.error or 'timed out'}")
        except BaseException as exc:  # noqa: BLE001 - reported by prestart (a background replacement: dropped)
            if errors is not None:
                errors.append(exc)

    def take(self):
        """An idle worker (process, connection), or a new one."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._spawn()

    def _spawn(self):
        """A new worker (process, connection)."""
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="mugrpo-call-worker")
        proc.start()
        child.close()
        return proc, parent

    def begin(self, call: Callable[[], Any], new: bool = False):
        """Send ``call`` to a worker (``new``: a new one, else an idle one if any) and wait until it has
        begun (bounded by :data:`WORKER_START_S`); the worker. Raises when the call does not pickle or
        unpickle, or the worker does not start."""
        proc, conn = self._spawn() if new else self.take()
        try:
            conn.send(call)
        except Exception:  # the call does not pickle: an error of that call, the worker is fine
            self._give_back(proc, conn)
            raise
        if not conn.poll(WORKER_START_S):
            self._kill(proc, conn)
            raise RuntimeError(f"the worker process did not start the call within {WORKER_START_S:g} s")
        try:
            kind, payload, exc = conn.recv()
        except (EOFError, OSError):
            self._kill(proc, conn)
            raise RuntimeError(f"the worker process died while starting the call (exit code {proc.exitcode})")
        if kind != "started":  # the call did not unpickle in the worker
            self._give_back(proc, conn)
            raise RuntimeError(f"the worker could not load the call:\n{payload}")
        return proc, conn

    def finish(self, worker, timeout_s: float) -> CallResult:
        """The call's result, or a timeout (the worker killed)."""
        proc, conn = worker
        if not conn.poll(timeout_s):
            self._kill(proc, conn)
            return CallResult(timed_out=True)
        try:
            kind, payload, exc = conn.recv()
        except (EOFError, OSError):  # the worker died (os._exit, a crash): an error, and the worker is gone
            self._kill(proc, conn)
            message = f"the worker process died (exit code {proc.exitcode}: os._exit or a crash in native code)"
            return CallResult(error=message, exception=ProcessExit(message, proc.exitcode), exited=proc.exitcode)
        except Exception as exc:  # noqa: BLE001 - a value or exception that does not unpickle here
            self._give_back(proc, conn)
            message = f"the call's result did not unpickle: {type(exc).__name__}: {exc}"
            return CallResult(error=message, exception=RuntimeError(message))
        self._give_back(proc, conn)
        if kind == "ok":
            return CallResult(value=payload)
        return CallResult(error=payload, exception=exc if exc is not None else RuntimeError(payload))

    def _kill(self, proc, conn) -> None:
        proc.kill()
        proc.join()
        conn.close()
        if self._warm is not None:  # prestarted: the replacement starts now, not inside the next call's step
            threading.Thread(target=self._start_one, daemon=True, name="mugrpo-call-worker-start").start()

    def _give_back(self, proc, conn) -> None:
        with self._lock:
            self._idle.append((proc, conn))


TOOL_RUNNER = CallRunner(16)
"""The runner tool environments share unless given their own."""
_PROCESS_TOOL_RUNNER: Optional[CallRunner] = None


def process_tool_runner() -> CallRunner:
    """The runner tool environments share under ``env.tool_isolation=process`` (made on first use)."""
    global _PROCESS_TOOL_RUNNER
    if _PROCESS_TOOL_RUNNER is None:
        _PROCESS_TOOL_RUNNER = CallRunner(16, isolation="process")
    return _PROCESS_TOOL_RUNNER


def run_calls(calls: list[Callable[[], Any]], max_workers: int, timeout_s: float) -> list[CallResult]:
    """Run ``calls`` on a runner of their own, at most ``max_workers`` at a time."""
    return CallRunner(max_workers).run(calls, timeout_s)
