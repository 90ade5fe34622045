"""Deliberate process death at named points, for the kill-and-resume tests.

``MUGRPO_DIE_AT="point:n"`` makes the process SIGKILL itself the n-th time (1-based) it passes
``point``; ``MUGRPO_STOP_AT="point:n"`` sends it SIGTERM there instead (a graceful stop that lands
exactly where the test says, whatever the machine's load); several, comma-separated
(``update:3,checkpoint_write:2``: a second SIGTERM inside the checkpoint the first one asked for).
Points: ``generate`` (after a generation batch, or a multi-turn turn in which a trajectory ended),
``decode`` (the HF engine's heartbeat after each decode step, or a turn in which none ended),
``eval`` (each progress call of an in-training evaluation: a decode step or finished sequences),
``round`` (after a dynamic-sampling round is persisted), ``update`` (after an optimizer update,
before its checkpoint), ``checkpoint_write`` (inside a checkpoint write, before the rename),
``sft_step`` (after a warm-start optimizer step, before its checkpoint: :mod:`mugrpo.warmstart.phase`),
``start`` (the CLI, as soon as its stop handler is held: before any heavy import), ``model_loaded``
(a phase's model, data and engine built, before its first step), ``phase_end`` (between a run's
warm start and its RL),
``serve_generate`` (an HF rollout service took a completions request and has not answered it:
:mod:`mugrpo.serve.hf_app`). ``MUGRPO_FREEZE_AT="point:n"`` sends SIGSTOP instead: the process
hangs there, alive but silent (a hung service). ``MUGRPO_HANG_AT="point:n"`` blocks only the thread
that passes ``point``, for good, while the process's other threads go on (a stuck engine whose server
still answers).
Unset in normal use; reading one environment variable is the whole cost.
"""

from __future__ import annotations

import os
import signal
import threading

_counts: dict[str, int] = {}


def _hang() -> None:
    threading.Event().wait()  # this thread never returns; the process's other threads go on


_ACTIONS = (("MUGRPO_DIE_AT", lambda: os.kill(os.getpid(), signal.SIGKILL)),
            ("MUGRPO_STOP_AT", lambda: os.kill(os.getpid(), signal.SIGTERM)),
            ("MUGRPO_FREEZE_AT", lambda: os.kill(os.getpid(), getattr(signal, "SIGSTOP", signal.SIGTERM))),
            ("MUGRPO_HANG_AT", _hang))
VARIABLES = tuple(variable for variable, _ in _ACTIONS)
"""The environment variables :func:`maybe_die` reads (a child process that must not inherit them drops these)."""


def maybe_die(point: str) -> None:
    for variable, act in _ACTIONS:
        spec = os.environ.get(variable)
        if not spec:
            continue
        nths = [int(nth or 1) for name, _, nth in (s.partition(":") for s in spec.split(",")) if name == point]
        if not nths:
            continue
        key = f"{variable}:{point}"
        _counts[key] = _counts.get(key, 0) + 1
        if _counts[key] in nths:
            act()


def should_poison(point: str) -> bool:
    """``MUGRPO_POISON_AT="point:n"``: True the n-th time ``point`` is passed (e.g. ``loss`` makes that
    update's loss NaN), to test that non-finite updates are skipped and counted; ``point:*``: every time."""
    spec = os.environ.get("MUGRPO_POISON_AT")
    if not spec:
        return False
    name, _, nth = spec.partition(":")
    if name != point:
        return False
    key = f"poison:{point}"
    _counts[key] = _counts.get(key, 0) + 1
    return nth == "*" or _counts[key] == int(nth or 1)
