"""The veto across turns, and the by-turn diagnostics, on hand-computed trajectories."""
import math

import torch

from mugrpo.algo.turns import first_trigger_turn, first_trigger_turn_counts, per_turn_counts, safe_ratio
from mugrpo.algo.veto import veto_mask
import pytest

pytestmark = pytest.mark.unit

X = -20.0  # log rho far below log(1e-4) = -9.2: a trigger wherever it is a loss token
# Four trajectories of 7 response tokens; turns: policy turn k >= 0, environment -1.
TURNS = torch.tensor([
    [0, 0, -1, -1, 1, 1, 1],   # A, A < 0: triggers at 1 (turn 0); the X at 2 is an environment token
    [0, 0, -1, 1, 1, -1, 2],   # B, A < 0: X on environment tokens 2 and 5, a trigger at 4 (turn 1)
    [0, 0, -1, -1, 1, 1, 1],   # C, A > 0: X everywhere, never touched
    [0, 0, -1, -1, 1, 1, 1],   # D, A < 0: X only on an environment token: no trigger
])
LOG_RATIO = torch.tensor([
    [0, X, X, 0, 0, 0, 0],
    [0, 0, X, 0, X, X, 0],
    [X] * 7,
    [0, 0, X, 0, 0, 0, 0],
])
ADV = torch.tensor([-1.0, -1.0, 1.0, -1.0])
MASK = TURNS >= 0  # the loss mask collate builds for multi-turn data


def _veto(scope):
    return veto_mask(LOG_RATIO, ADV, MASK, delta=1e-4, scope=scope)


def test_suffix_drops_later_policy_tokens_in_later_turns_and_never_environment_tokens():
    v = _veto("suffix")
    # A: kappa = 1 -> every later POLICY token: 4, 5, 6 (turn 1); env tokens 2, 3 are not loss tokens.
    # B: kappa = 4 (the X at 2 is an env token) -> 6 (turn 2); 5 is an env token.
    expected = torch.zeros(4, 7, dtype=torch.bool)
    expected[0, [4, 5, 6]] = True
    expected[1, 6] = True
    assert torch.equal(v.vetoed, expected)
    assert v.first_trigger.tolist() == [1, 4, -1, -1]
    assert not (v.trigger & ~MASK).any()  # environment tokens never trigger


def test_other_scopes_across_turns():
    trigger = _veto("trigger").vetoed
    assert trigger.nonzero().tolist() == [[0, 1], [1, 4]]
    sequence = _veto("sequence").vetoed
    # Every policy token of A and B (5 each: A 0,1,4,5,6; B 0,1,3,4,6), nothing of C or D.
    assert sequence[0].nonzero().flatten().tolist() == [0, 1, 4, 5, 6]
    assert sequence[1].nonzero().flatten().tolist() == [0, 1, 3, 4, 6]
    assert not sequence[2:].any()


def test_first_trigger_turn_and_vetoed_fraction_per_turn():
    v = _veto("suffix")
    first = first_trigger_turn(v.first_trigger, TURNS)
    assert first.tolist() == [0, 1, -1, -1]  # A's kappa = 1 is turn 0, B's kappa = 4 is turn 1
    assert first_trigger_turn_counts(first, 3).tolist() == [1.0, 1.0, 0.0]
    sums, counts = per_turn_counts(v.vetoed, MASK, TURNS, num_turns=3)
    # Policy tokens per turn: turn 0: 2 x 4 = 8; turn 1: A 3 + B 2 + C 3 + D 3 = 11; turn 2: B 1.
    # Vetoed: turn 1: A's 3; turn 2: B's 1.
    assert counts.tolist() == [8.0, 11.0, 1.0] and sums.tolist() == [0.0, 3.0, 1.0]
    frac = safe_ratio(sums, counts)
    assert frac[0] == 0 and math.isclose(frac[1], 3 / 11, rel_tol=1e-6) and frac[2] == 1
    # Two buckets: turn 2 folds into "turn 1 or later": 12 tokens, 4 vetoed.
    sums, counts = per_turn_counts(v.vetoed, MASK, TURNS, num_turns=2)
    assert counts.tolist() == [8.0, 12.0] and sums.tolist() == [0.0, 4.0]
    assert first_trigger_turn_counts(first, 1).tolist() == [2.0]


def test_a_turn_nobody_reached_has_no_fraction():
    sums, counts = per_turn_counts(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, 2), 2)
    frac = safe_ratio(sums, counts)
    assert frac[0] == 0 and math.isnan(frac[1])


def test_turn_metrics_are_numerator_denominator_pairs():
    from mugrpo.algo.turns import turn_metrics

    v = _veto("suffix")
    m = turn_metrics(v.vetoed, v.first_trigger, MASK, TURNS, num_turns=3)
    # First-trigger turns 0 (A) and 1 (B): sum 1 over 2 sequences. Per turn: the counts above.
    assert m["loss/first_trigger_turn"].tolist() == [1.0, 2.0]
    assert [m[f"loss/veto_token_frac_turn{k}"].tolist() for k in range(3)] == [[0.0, 8.0], [3.0, 11.0], [1.0, 1.0]]
    # Split into two micro-batches (A, B | C, D), the sums of the pairs are the same numbers.
    halves = [turn_metrics(*(x[s] for x in (v.vetoed, v.first_trigger, MASK, TURNS)), num_turns=3)
              for s in (slice(0, 2), slice(2, 4))]
    for key in m:
        assert torch.equal(halves[0][key] + halves[1][key], m[key])
