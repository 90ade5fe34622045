import torch

from mugrpo.algo.advantages import group_advantages
import pytest

pytestmark = pytest.mark.unit


def test_group_advantages_std_scaled():
    # Group [1, 0, 0, 1]: mean 0.5, population std 0.5 -> A = +-0.5 / (0.5 + 1e-6) ~ +-1.
    # Group [1, 1, 1, 0]: mean 0.75, std sqrt(3/16)=0.4330127 -> A = 0.25/0.4330127 = 0.5773503, -1.7320508.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    adv, zero_var = group_advantages(rewards, std_scale=True, eps=0.0)
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.5773503, 0.5773503, 0.5773503, -1.7320508]])
    torch.testing.assert_close(adv, expected)
    assert zero_var.tolist() == [False, False]


def test_group_advantages_no_std_and_zero_variance():
    # Dr. GRPO: A = r - mean. Group [2, 0]: mean 1 -> [1, -1]. Group [3, 3]: zero variance -> [0, 0].
    rewards = torch.tensor([[2.0, 0.0], [3.0, 3.0]])
    adv, zero_var = group_advantages(rewards, std_scale=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    assert zero_var.tolist() == [False, True]


def test_zero_variance_group_gets_exact_zero_with_std_scaling():
    adv, zero_var = group_advantages(torch.tensor([[0.0, 0.0, 0.0]]), std_scale=True, eps=1e-6)
    assert adv.eq(0).all() and zero_var.item()
