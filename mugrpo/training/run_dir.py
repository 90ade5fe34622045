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

The names on disk are those of every earlier version, so old run directories keep working. Here:
the names and small readers/writers of the stage's generation metrics; what goes in the files lives
with their owners (:mod:`mugrpo.training.data`, :mod:`mugrpo.training.checkpoint`,
:mod:`mugrpo.observability.loggers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
LOCK_FILE = ".lock"
CHECKPOINTS_DIR = "checkpoints"
STAGES_DIR = "stages"
FINAL_MODEL_DIR = "final_model"
STAGE_METRICS_FILE = "stage_metrics.json"
REPLAY_FILE = "replay.json"
ROUNDS_DIR = "rounds"


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
    def replay(self) -> Path:
        return self.path / REPLAY_FILE

    def stage(self, stage: int) -> Path:
        """The folder of stage ``stage``'s data."""
        return self.stages / stage_name(stage)

    @staticmethod
    def stage_text(stage_dir: Path, world) -> Path:
        """The human-readable rollouts of this rank (``train.save_stage_text``)."""
        from mugrpo.training.data import text_path

        return text_path(stage_dir, world.rank, world.size)

    @staticmethod
    def write_stage_metrics(stage_dir: Path, metrics: dict) -> None:
        """Persist the stage's generation-phase metrics (atomically), before its shards."""
        from mugrpo.training.data import atomic_write_text  # torch: only when a stage is written

        Path(stage_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(stage_dir) / STAGE_METRICS_FILE, json.dumps(metrics, indent=1))

    @staticmethod
    def read_stage_metrics(stage_dir: Path) -> dict:
        """The metrics :meth:`write_stage_metrics` kept, or {} for a stage written before they were."""
        path = Path(stage_dir) / STAGE_METRICS_FILE
        return json.loads(path.read_text()) if path.is_file() else {}
