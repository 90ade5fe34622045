"""A run's hold on its directory, from its first piece of work to its end: one rule for
``mugrpo train`` (:func:`mugrpo.training.trainer.train`) and ``mugrpo sft``
(:func:`mugrpo.warmstart.phase.sft`).

:class:`RunClaim` is a context manager: inside it the run claims (prepares and locks) its directory
when it is ready to write, installs the SIGINT/SIGTERM handler and registers what must be closed.
On leaving, whatever the way out, the handler is restored, the registered objects are closed in
order and the lock is released. A new run that failed with an error keeps nothing it wrote unless
that holds work to resume (a checkpoint, stage data, a warm start:
:func:`mugrpo.training.checkpoint.discard_failed_start`), so the corrected command can be run
again; a stop (:class:`~mugrpo.training.checkpoint.Interrupted`), a full disk
(:class:`~mugrpo.training.checkpoint.DiskFullError`: its message gives the ``--resume`` command) and
a resume keep everything.
"""

from __future__ import annotations

from typing import Callable

from mugrpo.run_dir import RunDir
from mugrpo.training import checkpoint as ckpt


class RunClaim:
    def __init__(self, run_dir: RunDir, cfg, resume: bool, world):
        self.run_dir, self.cfg, self.resume, self.world = run_dir, cfg, resume, world
        self.existed = run_dir.path.is_dir()  # a directory found (empty) keeps itself when a failed start is undone
        self.lock = self.stopper = None
        self._closers: list[Callable[[], None]] = []

    def claim(self) -> None:
        """Check (new run) or read (resume) the directory, write what a run starts with, and lock it."""
        ckpt.prepare_run_dir(self.run_dir.path, self.cfg, self.resume, is_main=self.world.is_main)
        self.lock = ckpt.lock_run_dir(self.run_dir.path, self.world)

    def close_at_exit(self, close: Callable[[], None]) -> None:
        """Run ``close()`` when the claim ends (after the stop handler is restored, before the unlock)."""
        self._closers.append(close)

    def stop_on_signals(self, name_resume_command: bool = True) -> ckpt.GracefulStop:
        """Install the graceful SIGINT/SIGTERM handler; ``name_resume_command``: a second signal's
        message names ``mugrpo train --resume RUN_DIR``."""
        self.stopper = ckpt.GracefulStop(self.run_dir.path if name_resume_command else None)
        return self.stopper

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        failed_new_run = (isinstance(exc, Exception) and not self.resume and self.lock is not None
                          and not isinstance(exc, (ckpt.Interrupted, ckpt.DiskFullError)))
        for close in (self.stopper and self.stopper.restore, *self._closers, self.lock and self.lock.close):
            if close:
                close()
        if failed_new_run and ckpt.discard_failed_start(self.run_dir.path, keep_dir=self.existed):
            print(f"[mugrpo] removed what this run wrote in {self.run_dir.path}: it failed before writing anything "
                  "to resume from, so the corrected command can be run again")
        return False
