"""The run directory's layout: every file and folder name a run writes, in one place.

    RUN_DIR/
      config.yaml                 the resolved config (what a resume is checked against)
      metrics.jsonl               one JSON record per update, stage and evaluation
      .lock                       held while a process trains in this directory
      checkpoints/ckpt_UUUUUUU/   model, optimizer, scheduler, RNG, trainer_state.json, config.yaml
      stages/stage_KKK/           the stage's data: rollouts_rank{R}.safetensors, shards.json (the
                                  "generated" marker, written last), stage_metrics.json, rollouts*.jsonl
        rounds/                   dynamic sampling's finished rounds (round_RR_rank{R}.safetensors + .json),
                                  removed once the stage's shards are written (mugrpo.stages.rounds)
        behavior_weights.safetensors   a stage generated ahead that was in flight when the run stopped:
                                  the weights it is generated from (mugrpo.stages.ahead), removed
                                  once the stage is complete
      final_model/                the exported HF model (and tokenizer)
      replay.json                 a replaying run's source run directory (mugrpo.stages.replay)
      run.json                    the kind of run (sft, warmstart, rl, replay): which command resumes it
      warmstart/                  with warmstart.data: the warm start's own run directory (config.yaml,
                                  metrics.jsonl, checkpoints/, final_model/: the weights RL starts from)

The names on disk are those of every earlier version, so old run directories keep working. Here:
the names (a stage's shard and text files too), the atomic write every writer of the run directory
uses and its full-disk error, the error for a run directory that cannot be used, the kind of run and
the one command that resumes it (:func:`resume_command`), and the small readers/writers of the
stage's generation metrics; what goes in the files lives with their owners
(:mod:`mugrpo.stages.data`, :mod:`mugrpo.kit.checkpoint`, :mod:`mugrpo.observability.loggers`).
This module sits at the bottom of the layers (docs/ARCHITECTURE.md): it imports nothing of mugrpo's
but the errors, and no torch.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mugrpo.errors import UserError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".lock"
CHECKPOINTS_DIR = "checkpoints"
STAGES_DIR = "stages"
FINAL_MODEL_DIR = "final_model"
STAGE_METRICS_FILE = "stage_metrics.json"
REPLAY_FILE = "replay.json"
WARMSTART_DIR = "warmstart"
"""A run with ``warmstart.data``: the warm start's own run directory (config, metrics, checkpoints,
final_model), inside the RL run's."""
ROUNDS_DIR = "rounds"
RUN_FILE = "run.json"
"""``{"kind": ...}``: one of :data:`RUN_KINDS`, written when the run claims its directory."""
RUN_KINDS = ("rl", "replay", "sft", "warmstart")
"""rl: ``mugrpo train``; replay: ``mugrpo train --replay``; sft: ``mugrpo sft``; warmstart: the warm
start of a ``mugrpo train`` run with ``warmstart.data`` (``RUN_DIR/warmstart/``, resumed by resuming its
parent run)."""
SHARDS_FILE = "shards.json"
"""Written by rank 0 once every rank's shard is on disk: the stage is complete."""


class RunDirError(UserError, RuntimeError):
    """A run directory that cannot be used as asked (taken, locked, incomplete); the message says why."""


def stage_name(stage: int) -> str:
    return f"stage_{stage:03d}"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path):
        object.__setattr__(self, "path", Path(path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def lock(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def stages(self) -> Path:
        return self.path / STAGES_DIR

    @property
    def final_model(self) -> Path:
        return self.path / FINAL_MODEL_DIR

    @property
    def warmstart(self) -> Path:
        """The warm start's sub-run (``warmstart.data``: :mod:`mugrpo.warmstart.phase`)."""
        return self.path / WARMSTART_DIR

    @property
    def replay(self) -> Path:
        return self.path / REPLAY_FILE

    @property
    def run_file(self) -> Path:
        return self.path / RUN_FILE

    def kind(self) -> str | None:
        """The recorded kind of run (:data:`RUN_KINDS`), or None for a directory without one (a run
        from before kinds were recorded, or not a run). A warm start's folder inside a run is
        recognised by its place even without the file."""
        try:
            kind = json.loads(self.run_file.read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind is None and self.path.name == WARMSTART_DIR and (self.path.parent / CONFIG_FILE).is_file():
            return "warmstart"
        return kind if kind in RUN_KINDS else None

    def holds_work(self) -> bool:
        """Whether the directory holds work a resume would continue: a checkpoint, a stage's data (its
        shards' record), or its warm start's checkpoint or final model."""
        warm = RunDir(self.warmstart)
        return (any(self.checkpoints.glob("ckpt_*")) or any(self.stages.glob(f"stage_*/{SHARDS_FILE}"))
                or any(warm.checkpoints.glob("ckpt_*")) or warm.final_model.is_dir())

    def write_kind(self, kind: str) -> None:
        assert kind in RUN_KINDS, kind
        atomic_write_text(self.run_file, json.dumps({"kind": kind}))

    def stage(self, stage: int) -> Path:
        """The folder of stage ``stage``'s data."""
        return self.stages / stage_name(stage)

    @staticmethod
    def stage_text(stage_dir: Path, world) -> Path:
        """The human-readable rollouts of this rank (``train.save_stage_text``)."""
        return text_path(stage_dir, world.rank, world.size)

    @staticmethod
    def write_stage_metrics(stage_dir: Path, metrics: dict) -> None:
        """Persist the stage's generation-phase metrics (atomically), before its shards."""
        Path(stage_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(stage_dir) / STAGE_METRICS_FILE, json.dumps(metrics, indent=1))

    @staticmethod
    def read_stage_metrics(stage_dir: Path) -> dict:
        """The metrics :meth:`write_stage_metrics` kept, or {} for a stage written before they were."""
        path = Path(stage_dir) / STAGE_METRICS_FILE
        return json.loads(path.read_text()) if path.is_file() else {}


def resume_command(run_dir: Path, kind: str | None = None) -> str:
    """The one command that continues the run in ``run_dir``, right for its kind (``kind``, else the
    recorded one): ``mugrpo sft --resume`` for an sft run, the parent run's ``mugrpo train --resume``
    for a warm start inside one, ``mugrpo train --resume`` otherwise."""
    run_dir = Path(run_dir)
    kind = kind or RunDir(run_dir).kind()
    if kind == "sft":
        return f"mugrpo sft --resume {run_dir}"
    if kind == "warmstart":
        return f"mugrpo train --resume {run_dir.parent}"
    return f"mugrpo train --resume {run_dir}"


class DiskFullError(UserError, OSError):
    """The disk filled up while a checkpoint, a stage's data or the final model was written; the
    message says nothing was lost and how to continue."""


_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed writing", "file write failed", "unexpected pos")
"""torch.save's zip writer reports a failed write as a RuntimeError with one of these, and no errno."""


def write_failure(exc: BaseException) -> str | None:
    """What went wrong, in words, when ``exc`` is a full disk (or torch's errno-less failed write, or
    another library's, e.g. safetensors', that only says it in its text); else None."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
    if isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _TORCH_WRITE_FAILED):
        return "a write failed (torch gives no reason; almost always no space left on device)"
    for text in ("No space left on device", "Disk quota exceeded"):
        if text in str(exc):
            return text[0].lower() + text[1:]
    return None


def size_text(num_bytes: int) -> str:
    """``num_bytes`` for a person: "1.4 GB", "312 MB", "12 kB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{1 if num_bytes < 10 * scale else 0}f} {unit}"
    return f"{max(num_bytes // 1000, 1)} kB"


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete what an interrupted write left behind in ``run_dir``; returns the removed paths.

    Only with the run directory locked: the names are those of :func:`atomic_write`
    (``.NAME.tmp-PID``) and of the checkpoint and final-model folders built before their rename
    (``.tmp-NAME``), in the folders mugrpo writes them to.
    """
    run_dir = Path(run_dir)
    folders = [run_dir, RunDir(run_dir).checkpoints, *sorted(RunDir(run_dir).stages.glob("stage_*"))]
    removed = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name.startswith(".tmp-") or (path.name.startswith(".") and ".tmp-" in path.name):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(path)
    return removed


def shard_path(stage_dir: Path, shard: int) -> Path:
    """Shard ``shard`` of a stage's data (written by the rank of that number)."""
    return Path(stage_dir) / f"rollouts_rank{shard}.safetensors"


def snapshot_path(stage_dir: Path) -> Path:
    """The behaviour weights of a stage that was being generated ahead when the run stopped."""
    return Path(stage_dir) / "behavior_weights.safetensors"


def text_path(stage_dir: Path, rank: int, world_size: int) -> Path:
    """The human-readable jsonl of a rank's shard (one file, without a rank, for a single process)."""
    return Path(stage_dir) / ("rollouts.jsonl" if world_size == 1 else f"rollouts_rank{rank}.jsonl")


def atomic_write(path: Path, write) -> None:
    """``write(tmp_path)``, fsync, then rename over ``path``: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
