"""Dynamic sampling within a stage (DAPO, arXiv 2503.14476 section 3.2; issue 21 part 1): the rules.

On a task the model mostly fails, most prompt groups get the same reward for every response
(zero variance), so their advantages are 0 and they carry no gradient. With dynamic sampling a
stage generates its prompt groups in rounds and keeps the *informative* ones (nonzero reward
variance) until it holds the groups its updates need, or the rounds run out.

The rules, all pure (ints, lists and reward tensors in; no engine, config object, I/O or
collectives; the round loop that calls the engine is :func:`run_rounds`, which takes the engine
work and the cross-rank sums as callables):

- **Informative**: a group whose rewards are not all equal (:func:`informative_groups`), i.e. one
  with a nonzero advantage. With G = 1 no group is informative (one reward has no variance, and
  :func:`mugrpo.algo.advantages.group_advantages` gives it A = 0); verl keeps every group when
  n = 1, for estimators that can use them, ours cannot. The config refuses G = 1 anyway
  (``rollout.group_size`` >= 2).
- **Needed** (:func:`groups_needed`): the distinct groups the stage's updates draw,
  min(prompts_per_stage, prompts_per_update x planned updates): by default these are equal; a
  ``prompts_per_stage`` set below it is the user's choice to reuse groups (several passes), and is
  kept; above it, the extra groups would never be drawn.
- **Round sizes** (:func:`first_round_size`, :func:`next_round_size`): round 0 draws
  ceil(needed x oversample) prompts; each later round draws what the informative fraction observed
  so far predicts the shortfall needs, ceil(shortfall / fraction), never more than round 0 (memory
  stays bounded), and round 0's size again while nothing informative has been seen. Sizes are
  multiples of the number of ranks (whole groups per rank).
- **Stop** (:func:`round_decision`): when every rank holds its share of the needed groups, or
  after ``max_rounds`` rounds.
- **Which prompts** (:func:`draw_slice`): the stage's prompt draw is one seeded sequence
  (``Task.sample`` over the ``prompt-draw`` stream of :mod:`mugrpo.seeds`: concatenated
  permutations of the task's items); round r takes the next slice of it. So no prompt repeats
  within a stage while the task has more, round 0 is exactly the draw a stage makes without dynamic
  sampling, and the prompts of round r are a pure function of the earlier rounds' sizes: a run
  killed between rounds and resumed draws the same ones. (One stream sliced by offset, rather than
  an independent stream per round, because independent streams would repeat prompts across rounds.)
  Each round's engine sampling has its own seed (:func:`mugrpo.seeds.rollout_round_sampling`).
- **What is kept** (:func:`select_groups`): the first ``needed`` informative groups in draw order;
  if the rounds ran out short, the earliest uninformative groups fill the stage up to ``needed``
  (so the stage has the size it would have had without dynamic sampling, and a stage where nothing
  is informative trains exactly as today: zero advantages, zero gradient); the kept groups are then
  put back in draw order. ``loss.drop_zero_var_groups`` still applies afterwards.

Departures from verl's DAPO recipe (``recipe/dapo/dapo_ray_trainer.py``): verl draws a fixed
``gen_batch_size`` per round and raises once ``max_num_gen_batches`` is exceeded; here later rounds
are sized from the observed fraction, and running out of rounds trains on what was found (a
warning and the ``stage/...`` metrics say so).

Shapes: N prompt groups, G responses per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[N] bool for ``rewards`` [N, G]: the group's rewards are not all equal (so some A != 0).

    G = 1: all False (a single reward has no variance)."""
    # Imported here: the rest of this module is plain arithmetic that the torch-free plan uses.
    from mugrpo.algo.advantages import zero_variance_groups

    return ~zero_variance_groups(rewards)


def groups_needed(prompts_per_stage: int, prompts_per_update: int, planned_updates: int) -> int:
    """The distinct groups a stage's updates draw: min(prompts_per_stage, prompts_per_update x planned).

    ``planned_updates``: mu, or fewer where the run's budget ends the stage first (the adaptive
    stage's maximum length: it may end earlier, which is not known at generation time)."""
    return min(prompts_per_stage, prompts_per_update * planned_updates)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def first_round_size(needed: int, oversample: float, world_size: int = 1) -> int:
    """Prompts drawn in round 0: ceil(needed x oversample), rounded up to a multiple of the ranks.

    E.g. needed 32, oversample 1.5: 48 (a multiple of 1, 2, 4, 8, 16 ranks alike)."""
    return _round_up(max(math.ceil(needed * oversample - 1e-9), 1), world_size)


def next_round_size(shortfall: int, num_generated: int, num_informative: int, cap: int, world_size: int = 1
                    ) -> int:
    """Prompts drawn in a later round, from the informative fraction p observed so far.

    ``shortfall``: groups still missing (summed over ranks as the largest rank's shortfall x ranks,
    see :func:`run_rounds`). ceil(shortfall / p), at most ``cap`` (round 0's size); ``cap`` while
    p = 0. E.g. 10 missing at p = 12 / 48 = 0.25: 40 prompts; at p = 3 / 48: 160, capped at 48.
    """
    if shortfall <= 0:
        return 0
    if num_informative <= 0:
        return cap
    wanted = math.ceil(shortfall * num_generated / num_informative - 1e-9)
    return min(_round_up(wanted, world_size), cap)


def round_decision(shortfall: int, rounds_done: int, max_rounds: int) -> str | None:
    """Why the rounds stop after ``rounds_done`` of them, or None to draw another.

    ``"enough"``: no rank is short; ``"max_rounds"``: the rounds ran out (short)."""
    if shortfall <= 0:
        return "enough"
    if rounds_done >= max_rounds:
        return "max_rounds"
    return None


def draw_slice(sample: Callable[[int], list[int]], offset: int, size: int) -> list[int]:
    """Items ``offset .. offset + size`` of the stage's prompt draw ``sample(count)`` (the first
    ``count`` items of one seeded sequence, e.g. ``Task.sample`` with a fresh generator each call)."""
    return sample(offset + size)[offset:]


def select_groups(informative: Sequence[bool], needed: int) -> list[int]:
    """Draw positions of the groups kept: the first ``needed`` informative ones; short of that, the
    earliest uninformative ones fill up to ``needed``; returned in draw order.

    E.g. informative [F, T, F, T, T], needed 2: [1, 3]; needed 4: [0, 1, 3, 4]."""
    chosen = [i for i, flag in enumerate(informative) if flag][:needed]
    fill = [i for i, flag in enumerate(informative) if not flag][:max(needed - len(chosen), 0)]
    return sorted(chosen + fill)


# ---------------------------------------------------------------------------------------------
# The round loop, with the engine work and the cross-rank sums passed in.


@dataclass
class Rounds:
    """What the rounds of one stage produced on this rank (round r's groups follow round r-1's)."""

    sizes: list[int] = field(default_factory=list)
    """Prompts drawn per round, over all ranks (before the prompt-length rule drops any)."""
    informative: list[list[bool]] = field(default_factory=list)
    """Per round, per group generated on this rank."""
    stop: str = ""
    """Why the rounds stopped (:func:`round_decision`)."""

    @property
    def flat(self) -> list[bool]:
        return [flag for part in self.informative for flag in part]


def run_rounds(needed_per_rank: int, oversample: float, max_rounds: int, world_size: int,
               generate: Callable[[int, int, int], list[bool]],
               sum_over_ranks: Callable[[list[int]], list[int]] = lambda xs: xs,
               max_over_ranks: Callable[[int], int] = lambda x: x) -> Rounds:
    """Draw rounds until every rank holds ``needed_per_rank`` informative groups or ``max_rounds``.

    ``generate(round, offset, size)`` generates (or, on resume, reads back) round ``round``: the
    ``size`` prompts at ``offset`` of the stage's draw, this rank's share of them; it returns the
    informative flag of each group this rank got. The sums make every rank take the same decision.
    """
    rounds = Rounds()
    size = first_round_size(needed_per_rank * world_size, oversample, world_size)
    cap, offset = size, 0
    while True:
        rounds.informative.append(list(generate(len(rounds.sizes), offset, size)))
        rounds.sizes.append(size)
        offset += size
        flat = rounds.flat
        shortfall = max_over_ranks(max(needed_per_rank - sum(flat), 0)) * world_size
        rounds.stop = round_decision(shortfall, len(rounds.sizes), max_rounds) or ""
        if rounds.stop:
            return rounds
        num_generated, num_informative = sum_over_ranks([len(flat), sum(flat)])
        size = next_round_size(shortfall, num_generated, num_informative, cap, world_size)


# ---------------------------------------------------------------------------------------------
# What ``mugrpo plan`` shows.


def plan_rows(enabled: bool, needed: int, group_size: int, oversample: float, max_rounds: int,
              world_size: int = 1) -> list[tuple[str, str]]:
    """Rows for :func:`mugrpo.config.plan.format_plan`: the rounds of a full-length stage.

    ``needed``: :func:`groups_needed` for a stage of mu updates (a stage the budget shortens needs
    fewer)."""
    if not enabled:
        return [("dynamic sampling", "off")]
    first = first_round_size(needed, oversample, world_size)
    most = first * max_rounds
    return [
        ("dynamic sampling", f"on: keep groups with nonzero reward variance, at most {max_rounds} "
                             f"round{'s' if max_rounds != 1 else ''} per stage"),
        ("informative groups needed", f"{needed} per stage"),
        ("round 0 draws", f"{first} prompts ({oversample:g} x {needed}), {first * group_size} sequences"),
        ("later rounds draw", "shortfall / informative fraction so far, at most round 0's size"
         if max_rounds > 1 else "none (one round)"),
        ("sequences generated per stage", f"{first * group_size} .. {most * group_size}"),
    ]
