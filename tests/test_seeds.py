"""Every random stream gets its own seed, a pure function of its name and position."""
from mugrpo import seeds
import pytest

pytestmark = pytest.mark.unit


def test_streams_never_share_a_seed():
    # Before: the prompt draw and the minibatch order of a stage were both seed * 1_000_003 + stage.
    by_stream = [seeds.prompt_draw(0, 1), seeds.minibatch_order(0, 1), seeds.rollout_sampling(0, 1, 0),
                 seeds.eval_sampling(0)]
    assert len(set(by_stream)) == len(by_stream)
    # ... nor across positions: stages, ranks, run seeds.
    assert seeds.prompt_draw(0, 1) != seeds.prompt_draw(0, 2) != seeds.prompt_draw(1, 1)
    assert seeds.rollout_sampling(0, 1, 0) != seeds.rollout_sampling(0, 1, 1)


def test_seeds_are_pure_and_fit_torch():
    import torch

    assert seeds.minibatch_order(7, 3) == seeds.minibatch_order(7, 3)  # resume re-derives the same one
    values = [seeds.derive(s, "x", i) for s in range(20) for i in range(20)]
    assert all(0 <= v < 2**63 for v in values)
    torch.Generator().manual_seed(max(values))  # accepted
