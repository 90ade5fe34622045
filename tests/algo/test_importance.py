"""Truncated importance sampling (mugrpo.algo.importance): the weights and the mismatch sums on
hand-built log-probs, the arithmetic in the comments."""
import math

import pytest
import torch

from mugrpo.algo.importance import mismatch_sums, tis_weights
from mugrpo.algo.losses import LOG_RATIO_GUARD

pytestmark = pytest.mark.unit


def test_tis_weight_is_the_ratio_below_the_cap_and_the_cap_above_it():
    trainer = torch.tensor([[-1.0, -0.5, -2.0]])
    engine = torch.tensor([[-1.5, -1.5, -1.0]])
    # d = [0.5, 1.0, -1.0]: e^0.5 = 1.6487 < 2; e^1 = 2.718 capped to 2; e^-1 = 0.3679 (never capped below)
    w = tis_weights(trainer, engine, cap=2.0)
    assert w.shape == (1, 3)
    assert w.tolist()[0] == pytest.approx([math.exp(0.5), 2.0, math.exp(-1.0)], rel=1e-6)


def test_tis_weight_is_detached_and_guarded_below():
    trainer = torch.tensor([-1.0, -100.0], requires_grad=True)
    engine = torch.tensor([-1.0, -1.0])
    w = tis_weights(trainer, engine, cap=2.0)
    assert not w.requires_grad
    # d = [0, -99]: e^0 = 1; -99 is clamped at -LOG_RATIO_GUARD = -20, e^-20 = 2.06e-9 (not 1e-43)
    assert w.tolist() == pytest.approx([1.0, math.exp(-LOG_RATIO_GUARD)], rel=1e-6)


def test_mismatch_sums_by_hand():
    trainer = torch.tensor([-1.0, -0.5, -2.0])
    engine = torch.tensor([-1.5, -1.5, -1.0])
    sums = mismatch_sums(trainer, engine, cap=2.0)
    assert sums.dtype == torch.float64 and sums.shape == (5,)
    # d = [0.5, 1.0, -1.0]
    # |d|: 0.5 + 1 + 1 = 2.5
    # k3(d) = e^d - d - 1: (1.648721 - 1.5) + (2.718282 - 2) + (0.367879 + 1 - 1) = 0.148721 + 0.718282 + 0.367879
    # capped: d > ln 2 = 0.693 only for d = 1.0 -> 1
    # w: 1.648721 + 2 + 0.367879 = 4.016600; tokens: 3
    k3 = (math.exp(0.5) - 1.5) + (math.exp(1.0) - 2.0) + math.exp(-1.0)
    w = math.exp(0.5) + 2.0 + math.exp(-1.0)
    assert sums.tolist() == pytest.approx([2.5, k3, 1.0, w, 3.0], rel=1e-9)


def test_mismatch_sums_of_identical_logprobs_are_zero_but_the_count():
    lp = torch.tensor([-0.3, -2.0, -0.7, -1.1])
    # d = 0 everywhere: |d| = 0, k3(0) = 1 - 0 - 1 = 0, nothing capped, w = 1 each (sum 4), 4 tokens
    assert mismatch_sums(lp, lp.clone(), cap=2.0).tolist() == [0.0, 0.0, 0.0, 4.0, 4.0]
