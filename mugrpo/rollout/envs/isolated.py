"""Environments in worker processes (``env.step_isolation=process``, the default): each environment lives in a
process of its own, killable, so user code that exits the process (``os._exit``), crashes it or
holds the GIL ends one trajectory, counted, and never the run.

:class:`ProcessEnvironment` is what the rollout loop gets: an :class:`Environment` whose every call
(``reset``, ``step``, ``tools``, ``metrics``, ``close``) is sent to its worker, where the real
environment was made by the factory and keeps its state between calls. The worker starts (and the
factory runs) when the proxy is made, which :mod:`.start` bounds by ``env.reset_timeout_s``, so a
step's ``env.step_timeout_s`` is spent on the step alone. A call that does not answer within its
time kills the worker (:class:`TimeoutError`); a worker that died answers that call and every later
one with a :class:`~mugrpo.rollout.calls.ProcessExit` naming the environment and its exit code: the
loop counts the step as ``env_error`` or
``env_timeout``, as for any step that raised or hung. ``metrics()`` and ``close()`` of a dead worker
give ``{}`` and nothing: the step already counted the failure.

Workers are started by ``forkserver`` (a clean process forks each one: fast, and nothing of the
trainer's threads or tensors is inherited); the factory and what crosses to the worker must pickle
(a module-level class or function, plain arguments); one that does not (:class:`NotPortable`: it does
not pickle here, or does not unpickle in the worker) is run on threads instead by :mod:`.build`, which
says why. One process per live environment: a stage has
``rollout.group_size`` times its prompts of them at once, each costing a small process (tens of MB).

Under ``env.step_isolation=thread`` (the opt-in for speed) the environment runs in this process, on
the call runner's threads (:mod:`mugrpo.rollout.calls`): an exception, a hang, or an ``os._exit``
(turned into :class:`~mugrpo.rollout.calls.ProcessExit`) is caught, but a crash in native code or a
step that holds the GIL cannot be: they end or stall the whole run. This module knows nothing about
tokens or the loop.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import traceback
from typing import Any, Callable, Optional

from mugrpo.rollout.calls import ProcessExit
from mugrpo.rollout.envs.base import Environment

__all__ = ["ProcessEnvironment", "STEP_ISOLATIONS", "NotPortable"]

STEP_ISOLATIONS = ("thread", "process")


class NotPortable(Exception):
    """The environment's factory cannot cross to a worker process (it does not pickle, or does not
    unpickle there: a class defined inside a function, a lambda, an object holding a lock...)."""


def _serve(conn, payload: bytes) -> None:
    """The worker: make the environment, report its name, max turns and stop strings, then answer calls."""
    try:
        factory = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - the factory does not load here: the caller falls back
        conn.send(("unportable", f"{type(exc).__name__}: {exc}", None))
        return
    try:
        env = factory()
        conn.send(("ok", (f"{type(env).__module__}.{type(env).__qualname__}", env.max_turns, tuple(env.stop)), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which raises it there
        conn.send(("error", traceback.format_exc(limit=8), _portable(exc)))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        try:
            value = getattr(env, method)(*args)
            reply = ("ok", list(value) if method == "tools" else value, None)
        except BaseException as exc:  # noqa: BLE001 - the call's failure, reported
            reply = ("error", traceback.format_exc(limit=8), _portable(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - a value that does not pickle: say so instead
            conn.send(("error", f"{type(exc).__name__}: {exc} (sending back what {method} returned)", None))
        if method == "close":
            return


def _preload(factory) -> list[str]:
    """What the fork server imports once, when it starts (the first environment), so that no worker
    imports it again: the modules a call's arguments need (an item: :mod:`mugrpo.rollout.tasks`, which
    imports torch: seconds per worker otherwise), the environment's own module, and those its class
    names in ``preload_modules`` (what it imports lazily, e.g. skyrl-gym)."""
    target = getattr(factory, "func", factory)
    return ["mugrpo.rollout.envs.isolated", "mugrpo.rollout.envs.tools", "mugrpo.rollout.tasks",
            getattr(target, "__module__", None) or __name__, *getattr(target, "preload_modules", ())]


def _portable(exc: BaseException) -> Optional[BaseException]:
    """``exc`` when it pickles (it travels back to the caller), else None."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return None


class ProcessEnvironment(Environment):
    """An environment made by ``factory`` in a worker process of its own (see the module docstring).

    ``timeout_s``: how long a step may take before the worker is killed (the step's timeout; the
    loop's runner times the call too). ``start_timeout_s``: the worker's start and the factory, and
    each ``reset``, ``tools``, ``metrics`` and ``close`` (``env.reset_timeout_s``)."""

    def __init__(self, factory: Callable[[], Environment], timeout_s: float = 30.0, start_timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.env_name = getattr(getattr(factory, "func", factory), "__qualname__", type(factory).__name__)
        try:
            payload = pickle.dumps(factory)
        except Exception as exc:  # noqa: BLE001 - pickling user objects may raise anything
            raise NotPortable(f"{type(exc).__name__}: {exc}") from None
        self._lock = threading.Lock()
        self.start_timeout_s = start_timeout_s
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_preload(factory))
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, payload), daemon=True, name="mugrpo-env-worker")
        self._proc.start()
        child.close()
        self.env_name, self.max_turns, self.stop = self._call(None, (), start_timeout_s)

    def reset(self, item, seed: int):
        return self._call("reset", (item, seed), self.start_timeout_s)

    def step(self, action: str):
        return self._call("step", (action,))

    def tools(self) -> list:
        return self._call("tools", (), self.start_timeout_s)

    def metrics(self) -> dict:
        return self._call("metrics", (), self.start_timeout_s) if self._proc.is_alive() else {}

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._call("close", (), self.start_timeout_s)
            finally:
                self._kill()

    def _call(self, method: Optional[str], args: tuple, timeout_s: Optional[float] = None) -> Any:
        """Send one call (None: wait for the start report) and return its value, or raise its failure."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            try:
                if method is not None:
                    self._conn.send((method, args))
                ready = self._conn.poll(timeout_s)
            except (OSError, EOFError, BrokenPipeError):
                ready = True  # the worker is gone: recv says how
            if not ready:
                self._kill()
                raise TimeoutError(f"environment {self.env_name}: its worker process did not answer "
                                   f"{method or 'its start'} within {timeout_s:g} s, and was killed")
            try:
                kind, payload, exc = self._conn.recv()
            except (EOFError, OSError):
                self._kill()
                code = self._proc.exitcode
                raise ProcessExit(f"environment {self.env_name}: its worker process died during "
                                  f"{method or 'its start'} (exit code {code}: os._exit or a crash in native code)",
                                  code) from None
        if kind == "unportable":
            self._kill()
            raise NotPortable(payload)
        if kind == "error":
            if exc is not None:
                exc.add_note(f"in the environment's worker process:\n{payload}")
                raise exc
            raise RuntimeError(payload)
        return payload

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)
        self._conn.close()
