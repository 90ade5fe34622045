"""The seeded order in which a phase draws its data: one rule for RL's update minibatches and the
warm start's steps, so a resume needs no sampler state.
"""

from __future__ import annotations

import torch

from mugrpo import seeds


def seeded_slice(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The items of step ``step``: consecutive slices of seeded reshuffles.

    Pass p over the ``num_items`` items is permutation p of one ``torch.Generator`` seeded by ``seed``;
    step s takes positions s * batch_size .. (s + 1) * batch_size - 1 of the passes laid end to end (a
    step may straddle two passes). A pure function of (num_items, batch_size, step, seed).
    E.g. 3 items, batch 2: step 0 = pass 0's positions 0-1, step 1 = pass 0's 2 and pass 1's 0.
    """
    start = step * batch_size
    first, last = start // num_items, (start + batch_size - 1) // num_items
    gen = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(num_items, generator=gen) for _ in range(last + 1)]
    order = torch.cat(perms[first:])
    offset = start - first * num_items
    return order[offset: offset + batch_size].tolist()


def update_groups(num_groups: int, prompts_per_update: int, update_in_stage: int, seed: int, stage: int
                  ) -> list[int]:
    """Group indices of RL update ``update_in_stage`` of a stage: :func:`seeded_slice` over the stage's
    groups, passes seeded by (seed, stage) (:func:`mugrpo.seeds.minibatch_order`)."""
    return seeded_slice(num_groups, prompts_per_update, update_in_stage, seeds.minibatch_order(seed, stage))


def step_examples(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of warm-start step ``step``: :func:`seeded_slice` over the examples, epochs seeded by
    :func:`mugrpo.seeds.sft_order`."""
    return seeded_slice(num_examples, batch_size, step, seeds.sft_order(seed))
