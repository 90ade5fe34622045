"""The seeded data order shared by RL and the warm start (mugrpo.kit.order)."""
import pytest
import torch

from mugrpo import seeds
from mugrpo.kit.order import seeded_slice, step_examples, update_groups

pytestmark = pytest.mark.unit


def test_steps_are_consecutive_slices_of_seeded_passes():
    gen = torch.Generator().manual_seed(5)
    pass0, pass1 = torch.randperm(3, generator=gen).tolist(), torch.randperm(3, generator=gen).tolist()
    # 3 items, 2 a step: step 0 = pass 0's first two, step 1 = pass 0's last and pass 1's first
    assert seeded_slice(3, 2, 0, 5) == pass0[:2]
    assert seeded_slice(3, 2, 1, 5) == [pass0[2], pass1[0]]
    assert seeded_slice(3, 2, 2, 5) == pass1[1:]


def test_rl_and_the_warm_start_draw_with_their_own_seeds_through_one_rule():
    assert update_groups(6, 2, 4, 3, 1) == seeded_slice(6, 2, 4, seeds.minibatch_order(3, 1))
    assert step_examples(10, 4, 2, 3) == seeded_slice(10, 4, 2, seeds.sft_order(3))
    assert update_groups(6, 2, 0, 3, 1) != update_groups(6, 2, 0, 3, 2)  # each stage its own shuffles
