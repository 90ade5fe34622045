"""A stage generated in rounds (dynamic sampling): each round persisted, then the kept groups assembled.

The rules (sizes, stop, which prompts, which groups are kept) are :mod:`mugrpo.algo.dynamic`;
this module holds a round's files, turns the rounds into the stage's :class:`StageData`, and runs
a stage's generation phase in rounds (:func:`generate_in_rounds`) with the engine work passed in
by the trainer (this module knows no engine, task or config).

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
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from mugrpo.algo import dynamic
from mugrpo.stages.data import StageData, StageDataError, atomic_write_text, gather_groups
from mugrpo.run_dir import ROUNDS_DIR


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
    by_group = [(part, g) for part in rounds for g in range(part.num_groups)]
    return gather_groups([by_group[i] for i in kept], rounds[0])


# ---------------------------------------------------------------------------------------------
# The generation phase of a stage with dynamic sampling.


@dataclass(frozen=True)
class Ranks:
    """This process among the ranks, and the two reductions that make every rank decide alike
    (identities in a single process)."""

    rank: int = 0
    size: int = 1
    sum: Callable[[list], list] = lambda xs: xs
    max: Callable[[int], int] = lambda x: x


def generate_in_rounds(stage_dir: Path, ranks: Ranks, needed_per_rank: int, oversample: float, max_rounds: int,
                       draw: Callable[[int, int], list[int]],
                       generate: Callable[[int, list[int]], tuple[StageData, dict]],
                       after_round: Callable[[], None] = lambda: None) -> tuple[StageData, dict, dynamic.Rounds]:
    """Generate a stage's groups in rounds (:func:`mugrpo.algo.dynamic.run_rounds`), keep the
    selected ones (:func:`mugrpo.algo.dynamic.select_groups`); return this rank's stage data,
    the rounds' records summed (:func:`sum_records`, with the rewards' sum, sum of squares and
    count over every generated sequence added for :func:`round_metrics`) and the rounds.

    ``draw(offset, size)``: this rank's share of the stage draw's items ``offset .. offset + size``;
    ``generate(round, indices)``: generate, score and compute advantages for those items (the
    prompt-length rule may drop some), returning the round's data and its record (plain numbers);
    ``after_round()`` runs once a new round is persisted (the kill-and-resume tests die there).
    A round already on disk (a run killed between rounds) is read back, not generated.
    """
    rank = ranks.rank
    parts, records = [], []

    def one_round(round_index: int, offset: int, size: int) -> list[bool]:
        loaded = load_round(stage_dir, round_index, rank)
        if loaded is None:
            part, record = generate(round_index, draw(offset, size))
            save_round(stage_dir, round_index, rank, part, record)
            after_round()
        else:
            part, record = loaded
        parts.append(part)
        rewards = part.rewards.double()
        records.append({**record, "reward_sum": float(rewards.sum()), "reward_sq_sum": float((rewards ** 2).sum()),
                        "num_sequences": rewards.numel()})
        return dynamic.informative_groups(part.rewards.view(-1, part.group_size)).tolist()

    rounds = dynamic.run_rounds(needed_per_rank, oversample, max_rounds, ranks.size, one_round, ranks.sum, ranks.max)
    data = assemble(parts, dynamic.select_groups(rounds.flat, needed_per_rank))
    return data, sum_records(records), rounds


def sum_records(records: Sequence[dict]) -> dict:
    """The rounds' records as one: numbers summed, lists of numbers summed element by element, dicts
    of numbers (an environment's counts) summed key by key, anything else (e.g. a first traceback)
    the first round's that has it."""
    out: dict = {}
    for record in records:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            elif isinstance(value, list):
                out[key] = [a + b for a, b in zip(out[key], value)] if key in out else list(value)
            elif isinstance(value, dict):  # a key missing from a round counts 0 there
                seen = out.get(key, {})
                out[key] = {k: seen.get(k, 0) + value.get(k, 0) for k in sorted({*seen, *value})}
            elif out.get(key) is None:
                out[key] = value
    return out


def round_metrics(rounds: dynamic.Rounds, data: StageData, record: dict, needed_per_rank: int, world_size: int,
                  sum_over_ranks: Callable[[list[float]], list[float]] = lambda xs: xs) -> dict:
    """The stage's dynamic-sampling metrics, summed over ranks (``record``: :func:`generate_in_rounds`'s):

    ``stage/informative_frac`` informative groups / groups generated; ``stage/num_rounds``;
    ``stage/num_informative_groups`` (0: the stage found nothing to learn from);
    ``stage/num_groups_needed``; ``stage/num_extra_sequences`` sequences generated and not kept;
    ``perf/extra_generate_s`` their share of the generation seconds (pro rata by sequences);
    ``reward/mean`` and ``reward/std`` over EVERY generated sequence (the behaviour policy's reward,
    as without dynamic sampling; the kept groups' mean is biased towards 1/2 by the selection, and is
    ``stage/kept_reward_mean``).
    """
    flat, G = rounds.flat, data.group_size
    generated, informative, kept, r_sum, r_sq, n, kept_sum = sum_over_ranks(
        [len(flat), sum(flat), data.num_groups, record["reward_sum"], record["reward_sq_sum"],
         record["num_sequences"], float(data.rewards.double().sum())])
    extra = int(generated - kept) * G
    mean = r_sum / max(n, 1)
    return {"stage/informative_frac": informative / max(generated, 1), "stage/num_rounds": len(rounds.sizes),
            "stage/num_informative_groups": int(informative), "stage/num_groups_needed": needed_per_rank * world_size,
            "stage/num_extra_sequences": extra,
            "perf/extra_generate_s": record["generate_s"] * extra / max(generated * G, 1),
            "reward/mean": mean, "reward/std": math.sqrt(max(r_sq / max(n, 1) - mean * mean, 0.0)),
            "stage/kept_reward_mean": kept_sum / max(kept * G, 1)}
