"""A stage generated in rounds (dynamic sampling): each round persisted, then the kept groups assembled.

The rules (sizes, stop, which prompts, which groups are kept) are :mod:`mugrpo.training.dynamic`;
this module holds a round's files and turns the rounds into the stage's :class:`StageData`.

Each rank writes each finished round to ``STAGE_DIR/rounds/``: ``round_RR_rank{R}.safetensors``
(the round's groups with rewards and advantages; advantages are per group, so computing them a
round at a time equals computing them at once) and then ``round_RR_rank{R}.json`` (its counts and
clocks, see :func:`save_round`). The json is written last, atomically: a round whose json exists is
complete, and a run killed between rounds reads it back instead of generating it again. Once the
stage's own shards are written the round files are removed (:func:`remove_rounds`): the kept groups
live on in the shards, and a completed stage never reads its rounds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from mugrpo.training.data import StageData, StageDataError, atomic_write_text

ROUNDS_DIR = "rounds"


def round_paths(stage_dir: Path, round_index: int, rank: int) -> tuple[Path, Path]:
    """The data file and the completion record of round ``round_index`` on ``rank``."""
    base = Path(stage_dir) / ROUNDS_DIR / f"round_{round_index:02d}_rank{rank}"
    return base.with_suffix(".safetensors"), base.with_suffix(".json")


def save_round(stage_dir: Path, round_index: int, rank: int, data: StageData, record: dict) -> None:
    """Persist a finished round: its data, then ``record`` (plain JSON values: counts, seconds)."""
    data_path, record_path = round_paths(stage_dir, round_index, rank)
    data.save(data_path)
    atomic_write_text(record_path, json.dumps(record, sort_keys=True))


def load_round(stage_dir: Path, round_index: int, rank: int) -> tuple[StageData, dict] | None:
    """A round persisted by :func:`save_round`, or None if it did not finish."""
    data_path, record_path = round_paths(stage_dir, round_index, rank)
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise StageDataError(record_path, exc) from exc
    return StageData.load(data_path), record


def remove_rounds(stage_dir: Path) -> None:
    shutil.rmtree(Path(stage_dir) / ROUNDS_DIR, ignore_errors=True)


def assemble(rounds: Sequence[StageData], kept: Sequence[int]) -> StageData:
    """The stage's data: the groups at positions ``kept`` of the rounds' groups laid end to end
    (round 0's first, in each round's order), in that order."""
    if not rounds:
        raise ValueError("assemble needs at least one round")
    G = rounds[0].group_size
    by_group = [(part, g) for part in rounds for g in range(part.num_groups)]
    picked = [by_group[i] for i in kept]
    seqs = [(part, g * G + j) for part, g in picked for j in range(G)]
    with_trainer = all(part.trainer_logprobs is not None for part in rounds)

    def rows(name: str) -> torch.Tensor:
        return torch.stack([getattr(part, name)[s] for part, s in seqs]) if seqs else getattr(rounds[0], name)[:0]

    return StageData([part.prompts[g] for part, g in picked], [part.responses[s] for part, s in seqs],
                     [part.behavior_logprobs[s] for part, s in seqs], rows("rewards"), rows("advantages"),
                     rows("finished"), [part.item_indices[g] for part, g in picked], G,
                     trainer_logprobs=[part.trainer_logprobs[s] for part, s in seqs] if with_trainer else None)
