"""The trainer's side of the shared-folder weight channel (docs/SERVING.md, "The weight channel"): the
safetensors files a remote run writes into ``rollout.remote.weights_dir`` for its services to load, and
their removal.

A file is named ``mugrpo-HOST-PID-TOKEN-vVERSION.safetensors``: the trainer's host and process id say
whose it is, so a later trainer on the same host removes the files of trainers that are no longer
running (:func:`remove_dead_trainers_files`, at start). A trainer removes its own at ``close``, at
interpreter exit (``atexit``) and each previous version as soon as the services hold the next one; only a
SIGKILL (or a second SIGTERM, which aborts at once) leaves one behind, for the next trainer to remove.

A folder the trainer cannot write (read-only, full, not a folder) is a :class:`WeightsDirError` naming
``rollout.remote.weights_dir`` and the command to run again, never a raw ``SafetensorError``.

This module knows nothing about HTTP or the services; :mod:`.engine` asks them to load what it writes.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterable, Optional

import torch

from mugrpo.errors import UserError
from mugrpo.rollout.service import default_weights_dir
from mugrpo.run_dir import atomic_write, write_failure

_NAME = re.compile(r"^\.?mugrpo-(?P<host>.+)-(?P<pid>\d+)-(?P<token>[0-9a-f]{12})-v\d+\.safetensors(\.tmp-\d+)?$")
"""A weights file (or the temporary it is written under, :func:`mugrpo.run_dir.atomic_write`)."""

RESUME = "mugrpo train --resume RUN_DIR"


class WeightsDirError(UserError):
    """``rollout.remote.weights_dir`` cannot take the weights file (read-only, full, not a folder)."""


def host_name() -> str:
    """This machine's name as it appears in file names (characters other than letters, digits, ``.``
    and ``_`` become ``_``)."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "host"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # another user's process: alive
        return True
    return True


def remove_dead_trainers_files(folder: Path, host: Optional[str] = None) -> list[Path]:
    """Remove the weights files (and temporaries) in ``folder`` that trainers on this host wrote and that
    outlived them (their process is gone); returns what was removed. Files of other hosts are left alone
    (a shared folder: their trainers may be alive)."""
    host, removed = host or host_name(), []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for path in entries:
        found = _NAME.match(path.name)
        if found and found["host"] == host and not pid_alive(int(found["pid"])):
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


class WeightsFolder:
    """One trainer's files in ``folder``: :meth:`prepare` at start (rank 0), :meth:`write` per version,
    :meth:`close` at the end (also run at interpreter exit)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.prefix = f"mugrpo-{host_name()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.files: list[Path] = []
        self._registered = False

    def _error(self, what: str, exc: BaseException, again: str) -> WeightsDirError:
        why = write_failure(exc) or f"{type(exc).__name__}: {exc}"
        return WeightsDirError(f"rollout.remote.weights_dir={self.folder}: {what} ({why}). Give a folder the trainer "
                               f"can write, with room for a copy of the model, that every service reads as its "
                               f"--weights-dir (default {default_weights_dir()}); then {again}")

    def prepare(self) -> list[Path]:
        """Remove dead trainers' files, check that the folder takes a file; returns what was removed."""
        removed = remove_dead_trainers_files(self.folder)
        if removed:
            print(f"[mugrpo] removed {len(removed)} weights file(s) of trainers no longer running from {self.folder}",
                  file=sys.stderr, flush=True)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, prefix=f".{self.prefix}-probe-") as probe:
                probe.write(b"mugrpo")
                probe.flush()
        except OSError as exc:
            raise self._error("the trainer cannot write there", exc,
                              f"run the command again (a resumed run: {RESUME})") from None
        if not self._registered:
            atexit.register(self.close)
            self._registered = True
        return removed

    def path(self, version: int) -> Path:
        return self.folder / f"{self.prefix}-v{version:06d}.safetensors"

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: str, version: int) -> Path:
        """Write the tensors (cast to ``dtype``, on the CPU) as ``version``, atomically: a service never
        sees a half-written file. ValueError when there are none; WeightsDirError when the folder fails."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        cast = getattr(torch, dtype)
        state = {name: t.detach().to(device="cpu", dtype=cast).contiguous() for name, t in named_tensors}
        if not state:
            raise ValueError("RemoteEngine.load_weights got no tensors; the services keep their old weights")
        final = self.path(version)
        try:
            atomic_write(final, lambda tmp: save_file(state, str(tmp)))
        except (OSError, SafetensorError, RuntimeError) as exc:
            raise self._error(f"writing weights version {version} failed", exc,
                              f"continue the run with: {RESUME} (the stage in flight is generated again)") from None
        self.files.append(final)
        return final

    def remove_before(self, keep: Path) -> None:
        """Remove this trainer's files other than ``keep`` (the version the services now hold)."""
        for path in [p for p in self.files if p != keep]:
            path.unlink(missing_ok=True)
            self.files.remove(path)

    def close(self) -> None:
        """Remove every file of this trainer (idempotent)."""
        for path in self.files:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        self.files = []
        if self._registered:
            atexit.unregister(self.close)
            self._registered = False
