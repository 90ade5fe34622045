"""Stopping a run on SIGINT/SIGTERM, from the first second of a command to its last write.

This module sits at the bottom of the layers and imports no torch, so the CLI installs the handler
before it imports anything heavy (:func:`hold`): a signal during imports, data rendering, model
loading or between a warm start and RL is recorded, never fatal and never silent. The run's
lifecycle (:class:`mugrpo.kit.lifecycle.RunLifecycle`) adopts the handler that is there, names its run
directory (so every message gives the command that resumes it, :func:`mugrpo.run_dir.resume_command`)
and stops at its next safe point; long loops outside the training loops call :func:`check`.

Not here: what a safe point is (the loops decide: an update is finished and checkpointed, a stage
being generated is discarded), and checkpoints (:mod:`mugrpo.kit.checkpoint`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Iterator

from mugrpo.run_dir import resume_command


class Interrupted(Exception):
    """The run stopped on SIGINT/SIGTERM at a safe point; the message says how to continue.

    ``run_dir``: the run's directory, or None when the stop came before the run claimed one (nothing
    was written, so the same command starts it again)."""

    def __init__(self, run_dir: Path | None, kind: str | None = None):
        if run_dir is None:
            text = "stopped before the run wrote anything; run the same command again to start it"
        else:
            text = f"training stopped cleanly and checkpointed. Resume with: {resume_command(run_dir, kind)}"
        super().__init__(text)
        self.run_dir = run_dir


class GracefulStop:
    """SIGINT/SIGTERM set ``requested``; the loops stop at their next safe point: an update is finished
    and checkpointed, a stage being generated is discarded (the last checkpoint is its start; a
    resume generates it again). The generation checks between the engine's decode steps (HF and
    vLLM), between turns, and after scoring (:mod:`mugrpo.stages.generation`); an evaluation inside
    training checks between its decode steps too, and is then run by the resumed run
    (:class:`~mugrpo.training.evaluator.TrainingEvaluator`).

    A second signal aborts at once: a second SIGINT raises KeyboardInterrupt (as Ctrl-C does without
    this handler), a second SIGTERM ends the process by SIGTERM's default action, without a
    checkpoint; the command that resumes from the last complete checkpoint is printed (``run_dir``
    names the run once the lifecycle has claimed it)."""

    def __init__(self, run_dir: Path | None = None):
        self.requested = False
        self.run_dir = run_dir
        self.kind: str | None = None
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            resume = f": {resume_command(self.run_dir, self.kind)}" if self.run_dir is not None else ""
            print(f"\n[mugrpo] second {name}: aborting at once, without a checkpoint; resume continues from the "
                  f"last complete checkpoint{resume}", flush=True)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True
        print(f"\n[mugrpo] {name} received: stopping at the next safe point (the current update is finished and "
              "checkpointed; a stage being generated is discarded and generated again on resume). Send it again "
              "(Ctrl-C again) to abort at once", flush=True)

    def check(self) -> None:
        """Raise :class:`Interrupted` if a stop was requested (for safe points outside the loops)."""
        if self.requested:
            raise Interrupted(self.run_dir, self.kind)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


_current: GracefulStop | None = None


def current() -> GracefulStop | None:
    """The handler a :func:`hold` installed, or None outside one."""
    return _current


@contextlib.contextmanager
def hold() -> Iterator[GracefulStop]:
    """The stop handler for the block: the one already held (the CLI holds one for the whole command),
    else a new one, restored when the block ends (``mugrpo.train`` called from Python)."""
    global _current
    if _current is not None:
        yield _current
        return
    _current = GracefulStop()
    try:
        yield _current
    finally:
        _current.restore()
        _current = None


def check() -> None:
    """Raise :class:`Interrupted` if a stop was requested under the held handler; for long work outside
    the training loops (rendering demonstrations, loading data)."""
    if _current is not None:
        _current.check()
