"""pass@k, avg@n and greedy accuracy on cases small enough to check by hand."""

import itertools
import math

import pytest

from mugrpo.evaluation.metrics import macro_average, pass_at_k, summarize

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25),          # 1 - C(3,1)/C(4,1) = 1 - 3/4
    (4, 1, 2, 0.5),           # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, 5 / 6),         # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (5, 2, 3, 0.9),           # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 5, 11 / 12),      # 1 - C(7,5)/C(10,5) = 1 - 21/252 = 1 - 1/12
    (4, 3, 2, 1.0),           # n - c = 1 < k = 2: every pair holds a correct sample
    (8, 0, 8, 0.0),           # nothing correct
    (8, 8, 1, 1.0),           # everything correct
    (8, 1, 8, 1.0),           # k = n: solved if any sample is
    (200, 1, 1, 0.005),       # pass@1 = c/n = 1/200, no overflow at large n
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_not_the_plugin_estimate():
    # n=4, c=1, k=2: the plug-in 1 - (1 - 1/4)^2 = 7/16 = 0.4375 is biased; the estimator gives 0.5.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 2) != pytest.approx(7 / 16)


def test_pass_at_k_equals_the_mean_over_all_k_subsets():
    # The estimator's definition: the fraction of k-subsets of the n samples with a correct one.
    samples = [1, 0, 0, 1, 0, 0, 0]
    for k in range(1, len(samples) + 1):
        subsets = list(itertools.combinations(samples, k))
        by_enumeration = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(len(samples), sum(samples), k) == pytest.approx(by_enumeration)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_summarize_by_hand():
    greedy = [1.0, 0.0, 0.5]                           # mean 0.5
    samples = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    out = summarize(greedy, samples, ks=[1, 2])
    assert out["greedy_acc"] == pytest.approx(0.5)
    assert out["avg_at_4"] == pytest.approx(0.375)     # (1/4 + 2/4) / 2
    assert out["pass_at_1"] == pytest.approx(0.375)    # pass@1 = c/n per item, same mean
    assert out["pass_at_2"] == pytest.approx(2 / 3)    # (1 - 3/6 + 1 - 1/6) / 2 = (1/2 + 5/6) / 2
    assert out["informative_frac_at_4"] == 1.0         # both items' samples disagree
    assert set(out) == {"greedy_acc", "avg_at_4", "pass_at_1", "pass_at_2", "informative_frac_at_4"}


def test_informative_fraction_counts_items_whose_samples_disagree():
    # [1, 0] and [0.5, 1] disagree, [1, 1] and [0, 0] do not: 2 of 4 items would give GRPO a gradient.
    out = summarize(None, [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.5, 1.0]])
    assert out["informative_frac_at_2"] == 0.5
    assert "informative_frac_at_1" not in summarize(None, [[1.0], [0.0]])  # one sample has no variance


def test_partial_credit_counts_in_averages_not_in_pass_at_k():
    out = summarize(None, [[0.5, 1.0]], ks=[1, 2])
    assert out["avg_at_2"] == pytest.approx(0.75)      # (0.5 + 1.0) / 2
    assert out["pass_at_1"] == pytest.approx(0.5)      # only the 1.0 counts: c = 1 of n = 2
    assert out["pass_at_2"] == pytest.approx(1.0)
    lenient = summarize(None, [[0.5, 1.0]], ks=[1], correct_at=0.5)
    assert lenient["pass_at_1"] == pytest.approx(1.0)  # both count at correct_at = 0.5


def test_summarize_edge_cases():
    assert math.isnan(summarize([], None)["greedy_acc"])
    with pytest.raises(ValueError):
        summarize(None, [[1.0], [1.0, 0.0]], ks=[1])


def test_macro_average_is_unweighted_over_shared_keys():
    tasks = [{"greedy_acc": 1.0, "pass_at_4": 0.5}, {"greedy_acc": 0.0}]
    assert macro_average(tasks) == {"greedy_acc": 0.5}  # pass_at_4 missing in one task: left out
    assert macro_average([]) == {}
