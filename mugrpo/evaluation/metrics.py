"""Evaluation metrics as pure functions of per-sample scores: greedy accuracy, avg@n, pass@k.

Definitions (per item i with n sampled responses, c_i of them correct):
- greedy accuracy: mean over items of the greedy response's score;
- avg@n: mean over items of the mean score of the n samples (for 0/1 scores this is the
  unbiased pass@1);
- pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): the
  probability that at least one of k responses drawn without replacement from the n is correct,
  1 - C(n - c, k) / C(n, k), averaged over items. Unbiased for every k <= n, unlike the plug-in
  1 - (1 - c/n)^k.

A sample counts as correct for pass@k when its score is at least ``correct_at`` (default 1.0:
full credit), so partial-credit scorers (reasoning-gym gives 0.01 for some near misses) do not
count as solved. Averages use the raw scores.

No models, engines, tasks or I/O here: lists of floats in, floats out.
"""

from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one item: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), the numerically stable product form of the
    binomial ratio (no factorials). Returns 1.0 when n - c < k (every k-subset holds a correct
    sample).
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(greedy_scores: Sequence[float] | None, sample_scores: Sequence[Sequence[float]] | None,
              ks: Sequence[int] = (), correct_at: float = 1.0) -> dict[str, float]:
    """Item-averaged metrics: ``greedy_acc``, ``avg_at_{n}``, ``pass_at_{k}`` for each k in ``ks`` and,
    with n >= 2, ``informative_frac_at_{n}``: the fraction of items whose samples' scores are not all
    equal, i.e. whose GRPO group of n would carry a gradient (before RL: will it learn anything?).

    ``greedy_scores`` [items]; ``sample_scores`` [items][n] (every item the same n). Keys whose
    inputs are missing are left out; an empty item list gives NaN means.
    """
    out: dict[str, float] = {}
    if greedy_scores is not None:
        out["greedy_acc"] = _mean(list(greedy_scores))
    if sample_scores is not None:
        n = len(sample_scores[0]) if sample_scores else 0
        if any(len(s) != n for s in sample_scores):
            raise ValueError("summarize: every item needs the same number of samples")
        out[f"avg_at_{n}"] = _mean([_mean(s) for s in sample_scores])
        if n >= 2:  # items whose n samples disagree: a GRPO group of size n there has a gradient
            out[f"informative_frac_at_{n}"] = _mean([float(len(set(s)) > 1) for s in sample_scores])
        counts = [sum(1 for x in s if x >= correct_at) for s in sample_scores]
        for k in sorted(set(ks)):
            out[f"pass_at_{k}"] = _mean([pass_at_k(n, c, k) for c in counts])
    return out


def macro_average(per_task: Sequence[dict[str, float]]) -> dict[str, float]:
    """Unweighted mean over tasks of every key all tasks share (the paper's "average" column)."""
    if not per_task:
        return {}
    shared = set(per_task[0]).intersection(*per_task[1:])
    return {key: _mean([t[key] for t in per_task]) for key in per_task[0] if key in shared}
