"""The optimizer update on multi-turn stage data: environment tokens are inputs, never loss tokens.

Checked against a hand-assembled reference (the plain layout, the loss over policy tokens only,
normalised by the policy-token count), in float64 so agreement is to rounding (test_batching.py's
FP64_TOL), and through every fast path the update takes: zero-advantage skip, shared prefix,
token-budget micro-batches.
"""
import pytest
import torch
from kit.test_batching import FP64_TOL, PLAIN, _relative_error, _stage, _update, exact_rmsnorm  # noqa: F401

G = 4
ADV = [0.0] * 4 + [1.0, -1.0, 0.5, -0.5] + [-1.5, 0.5, 0.5, 0.5] + [1.0, 1.0, -1.0, -1.0]


def _multi_turn(seed=0, env_logprob=0.0):
    """4 groups of G = 4 trajectories (the first with A = 0); each response: a policy turn, an
    environment turn, a policy turn."""
    lengths = [(3 * s) % 5 + 2 for s in range(4 * G)]
    env_lens = [(s % 3) + 2 for s in range(4 * G)]
    last = [(s % 4) + 1 for s in range(4 * G)]
    data = _stage(100, [7, 10, 5, 8], [a + b + c for a, b, c in zip(lengths, env_lens, last)], G=G, advantages=ADV,
                  seed=seed)
    data.turns = [[0] * a + [-1] * b + [1] * c for a, b, c in zip(lengths, env_lens, last)]
    for s, turns in enumerate(data.turns):  # env tokens: whatever is stored there must not matter
        data.behavior_logprobs[s] = [env_logprob if k < 0 else x for x, k in zip(data.behavior_logprobs[s], turns)]
    return data


@pytest.mark.parametrize("extra", [[], ["loss.veto_normalizer=post_veto"], ["loss.aggregation=seq-mean-token-mean"],
                                   ["schedule.micro_batch_tokens=40"]])
def test_multi_turn_update_equals_the_plain_path_and_ignores_env_token_logprobs(tiny_model_dir, exact_rmsnorm, extra):
    plain, plain_m = _update(tiny_model_dir, _multi_turn(), PLAIN + extra, lr=1.0)  # SGD lr 1: change = -gradient
    fast, fast_m = _update(tiny_model_dir, _multi_turn(env_logprob=-7.0), extra, lr=1.0)
    assert fast_m["loss/trained_seq_frac"] == 0.75 and plain_m["loss/trained_seq_frac"] == 1.0
    for a, b in zip(fast, plain):
        assert _relative_error(a, b) <= FP64_TOL
    # The metric is summed over micro-batches in float32 (the metric pairs' dtype): 1e-6 relative.
    assert fast_m["loss/policy"] == pytest.approx(plain_m["loss/policy"], rel=1e-6)


def test_the_update_is_the_gradient_of_the_policy_token_loss_over_the_policy_token_count(tiny_model_dir,
                                                                                          exact_rmsnorm):
    # Reference by hand: the plain layout's log-probs, policy_loss over response_mask (policy tokens
    # only) with denominator = the number of policy tokens; its gradient must be the update's (SGD,
    # lr 1). A normaliser counting env tokens too would scale the update by policy / all tokens.
    from conftest import TINY_OVERRIDES

    from mugrpo.algo.losses import LossInputs, LossSettings, policy_loss
    from mugrpo.config import load_config
    from mugrpo.models.loading import load_policy
    from mugrpo.kit.batching import collate
    from mugrpo.kit.forward import response_logprobs

    data = _multi_turn()
    num_policy = sum(data.num_policy_tokens(s) for s in range(len(data.responses)))
    assert num_policy < sum(len(r) for r in data.responses)
    change, _ = _update(tiny_model_dir, data, [], lr=1.0)
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES])
    policy = load_policy(tiny_model_dir, dtype=torch.float64)
    torch.manual_seed(0)
    with torch.no_grad():  # _update's perturbation
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    mb = collate(data, list(range(len(data.responses))), pad_id=0)
    assert int(mb.response_mask.sum()) == num_policy
    logprobs, _ = response_logprobs(policy, mb, cfg.rollout.temperature, False, False, False)
    loss, _ = policy_loss(LossInputs(logprobs, mb.behavior_logprobs.double(), mb.advantages, mb.response_mask, float(num_policy)), LossSettings.from_config(cfg.loss, cfg.rollout.max_new_tokens))
    loss.backward()
    for c, p in zip(change, policy.parameters()):
        assert _relative_error(c, p.grad) <= FP64_TOL
