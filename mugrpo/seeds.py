"""Every random stream of a run, each seeded by its own named derivation of ``train.seed``.

Two streams seeded alike draw the same numbers: before this module, a stage's prompt draw and its
minibatch shuffles were both seeded with ``seed * 1_000_003 + stage``. Here a stream's seed is a
hash of its name, the run's seed and the stream's indices (stage, rank, ...), so the streams are
independent of one another, and each is a pure function of its position: a resumed run needs no
sampler state.
"""

from __future__ import annotations

import hashlib


def derive(seed: int, stream: str, *index: int) -> int:
    """A 63-bit seed for ``stream`` at ``index`` (what ``torch.manual_seed`` and generators accept)."""
    text = ":".join([stream, str(seed), *map(str, index)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def prompt_draw(seed: int, stage: int) -> int:
    """Which task items a stage samples."""
    return derive(seed, "prompt-draw", stage)


def minibatch_order(seed: int, stage: int) -> int:
    """The shuffles that cut a stage's data into update minibatches."""
    return derive(seed, "minibatch-order", stage)


def rollout_sampling(seed: int, stage: int, rank: int) -> int:
    """The engine's sampling of a stage's responses on one rank."""
    return derive(seed, "rollout-sampling", stage, rank)


def rollout_round_sampling(seed: int, stage: int, rank: int, round_index: int) -> int:
    """The engine's sampling in round ``round_index`` of a stage with dynamic sampling
    (:mod:`mugrpo.algo.dynamic`). Round 0 is :func:`rollout_sampling`: the sampling of a stage
    without dynamic sampling."""
    if round_index == 0:
        return rollout_sampling(seed, stage, rank)
    return derive(seed, "rollout-round-sampling", stage, rank, round_index)


def sft_order(seed: int) -> int:
    """The supervised warm start's order of demonstrations (every epoch's shuffle comes from it)."""
    return derive(seed, "sft-order")


def eval_sampling(seed: int) -> int:
    """Evaluation's sampling: the same at every evaluation, so differences come from the weights."""
    return derive(seed, "eval-sampling")


def env_reset(seed: int, stage: int, rank: int, round_index: int = 0) -> int:
    """The seeds environments are reset with in a stage on one rank (each member of each group
    derives its own from it: :func:`mugrpo.rollout.envs.start.reset_seed`); in round ``round_index``
    of a stage with dynamic sampling, round 0's being the stage's own."""
    if round_index == 0:
        return derive(seed, "env-reset", stage, rank)
    return derive(seed, "env-reset-round", stage, rank, round_index)
