"""The run directory's layout: every file and folder name a run writes, in one place.

    RUN_DIR/
      config.yaml                 the resolved config (what a resume is checked against)
      metrics.jsonl               one JSON record per update, stage and evaluation
      .lock                       held while a process trains in this directory
      checkpoints/ckpt_UUUUUUU/   model, optimizer, scheduler, RNG, trainer_state.json, config.yaml
      stages/stage_KKK/           the stage's data: rollouts_rank{R}.safetensors, shards.json (the
                                  "generated" marker, written last), stage_metrics.json, rollouts*.jsonl
        rounds/                   dynamic sampling's finished rounds (round_RR_rank{R}.safetensors + .json),
                                  removed once the stage's shards are written (mugrpo.training.rounds)
      final_model/                the exported HF model (and tokenizer)
      replay.json                 a replaying run's source run directory (mugrpo.training.replay)
      warmstart/                  with warmstart.data: the warm start's own run directory (config.yaml,
                                  metrics.jsonl, checkpoints/, final_model/: the weights RL starts from)

The names on disk are those of every earlier version, so old run directories keep working. Here:
the names (a stage's shard and text files too), the atomic write every writer of the run directory
uses, the error for a run directory that cannot be used, and the small readers/writers of the
stage's generation metrics; what goes in the files lives with their owners
(:mod:`mugrpo.training.data`, :mod:`mugrpo.training.checkpoint`, :mod:`mugrpo.observability.loggers`).
This module sits at the bottom of the layers (docs/ARCHITECTURE.md): it imports nothing of mugrpo's
but the errors, and no torch.
"""

from __future__ import annotations

import json
import os
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


def shard_path(stage_dir: Path, shard: int) -> Path:
    """Shard ``shard`` of a stage's data (written by the rank of that number)."""
    return Path(stage_dir) / f"rollouts_rank{shard}.safetensors"


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
