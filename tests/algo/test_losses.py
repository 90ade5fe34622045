import math

import pytest
import torch

from mugrpo.config import LossConfig
from mugrpo.algo.losses import (LossInputs, LossSettings, aggregate, clipped_surrogate, finalize_metrics, k3, m2po_tau,
                                policy_loss)
from mugrpo.algo.veto import veto_mask

pytestmark = pytest.mark.unit

LOG_DELTA = math.log(1e-4)  # -9.21



def loss_of(logprobs, behavior, adv, mask, *, denominator, ref_logprobs=None, entropy=None, seq_len_norm=1,
            **options):
    """policy_loss with the config's defaults (the relaxed Mu-GRPO loss) and ``options`` on top."""
    settings = LossSettings.from_config(LossConfig(**options), seq_len_norm)
    return policy_loss(LossInputs(logprobs, behavior, adv, mask, denominator, ref_logprobs=ref_logprobs, entropy=entropy), settings)

def lr(*ratios):
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float32)


def test_standard_clip_hand_cases():
    # A = +1: ratio 2 -> -min(2, 1.2) = -1.2 (high bound binds); ratio 0.5 -> -min(0.5, 0.8) = -0.5 (free).
    loss, lo, hi = clipped_surrogate(lr(2.0, 0.5), torch.tensor([1.0]), 0.8, 1.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5]]))
    assert hi.tolist() == [[True, False]] and lo.tolist() == [[False, False]]
    # A = -1: ratio 0.5 -> -min(-0.5, -0.8) = 0.8 (low bound binds); ratio 2 -> -min(-2, -1.2) = 2 (free).
    loss, lo, hi = clipped_surrogate(lr(0.5, 2.0), torch.tensor([-1.0]), 0.8, 1.2)
    torch.testing.assert_close(loss, torch.tensor([[0.8, 2.0]]))
    assert lo.tolist() == [[True, False]] and hi.tolist() == [[False, False]]


def test_relaxed_bounds_clip_only_above_5_for_positive_advantage():
    # [0, 5]: A = +1, ratio 4 -> -4 with gradient d(-rho)/dlog(rho) = -4; ratio 6 -> -5, gradient 0.
    x = lr(4.0, 6.0).requires_grad_(True)
    loss, lo, hi = clipped_surrogate(x, torch.tensor([1.0]), 0.0, 5.0)
    torch.testing.assert_close(loss, torch.tensor([[-4.0, -5.0]]))
    loss.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-4.0, 0.0]]))
    assert hi.tolist() == [[False, True]]
    # A = -1: the lower bound 0 never binds: ratio 0.01 -> -min(-0.01, -0.01) = 0.01, gradient rho*1 = 0.01.
    y = lr(0.01, 50.0).requires_grad_(True)
    loss, lo, hi = clipped_surrogate(y, torch.tensor([-1.0]), 0.0, 5.0)
    torch.testing.assert_close(loss, torch.tensor([[0.01, 50.0]]))
    loss.sum().backward()
    torch.testing.assert_close(y.grad, torch.tensor([[0.01, 50.0]]))
    assert not lo.any() and not hi.any()


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, ratio 10, c = 3: loss min(10, 3 * |A|) = 3; A = +1 untouched: -min(10, 5) = -5.
    loss, _, _ = clipped_surrogate(lr(10.0), torch.tensor([-1.0]), 0.0, 5.0, dual_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0]]))
    loss, _, _ = clipped_surrogate(lr(10.0), torch.tensor([1.0]), 0.0, 5.0, dual_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([[-5.0]]))


ROW = torch.tensor([[0.0, -10.0, 0.0, 0.0]])  # token 1 has rho = e^-10 < 1e-4: the first trigger
MASK = torch.ones(1, 4, dtype=torch.bool)


@pytest.mark.parametrize("scope,expected", [
    ("none", [0, 0, 0, 0]),
    ("trigger", [0, 1, 0, 0]),
    ("suffix", [0, 0, 1, 1]),  # kappa = 1 is kept; every t > 1 goes
    ("suffix_nontrigger", [0, 0, 1, 1]),
    ("sequence", [1, 1, 1, 1]),
])
def test_veto_scopes_on_negative_advantage(scope, expected):
    v = veto_mask(ROW, torch.tensor([-1.0]), MASK, delta=1e-4, scope=scope)
    assert v.vetoed.int().tolist() == [expected]
    assert v.trigger.int().tolist() == [[0, 1, 0, 0]]
    assert v.first_trigger.tolist() == [1]


def test_suffix_nontrigger_drops_later_triggers_from_the_suffix():
    # Triggers at 1 and 2: suffix = {2, 3}; minus the triggers -> {3}.
    row = torch.tensor([[0.0, -10.0, -10.0, 0.0]])
    v = veto_mask(row, torch.tensor([-1.0]), MASK, delta=1e-4, scope="suffix_nontrigger")
    assert v.vetoed.int().tolist() == [[0, 0, 0, 1]]
    v = veto_mask(row, torch.tensor([-1.0]), MASK, delta=1e-4, scope="suffix")
    assert v.vetoed.int().tolist() == [[0, 0, 1, 1]]


@pytest.mark.parametrize("scope", ["trigger", "suffix", "suffix_nontrigger", "sequence"])
def test_veto_never_touches_positive_or_zero_advantage(scope):
    rows = ROW.repeat(2, 1)
    v = veto_mask(rows, torch.tensor([1.0, 0.0]), MASK.repeat(2, 1), delta=1e-4, scope=scope)
    assert not v.vetoed.any() and not v.trigger.any()
    assert v.first_trigger.tolist() == [-1, -1]


def test_veto_respects_mask_and_threshold():
    # rho = e^-9 = 1.2e-4 is above delta = 1e-4: no trigger. A padded token (mask 0) never triggers.
    row = torch.tensor([[-9.0, 0.0, -10.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    v = veto_mask(row, torch.tensor([-1.0]), mask, delta=1e-4, scope="sequence")
    assert not v.trigger.any() and not v.vetoed.any()
    # With delta = 2e-4 (log = -8.52) token 0 triggers; the sequence scope drops real tokens only.
    v = veto_mask(row, torch.tensor([-1.0]), mask, delta=2e-4, scope="sequence")
    assert v.vetoed.int().tolist() == [[1, 1, 0]]


def _batch():
    # Two sequences of 4 tokens: seq 0 has A = -1 and a trigger at t = 1; seq 1 has A = +1.
    logprobs = torch.tensor([[-1.0, -12.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    behavior = torch.tensor([[-1.0, -1.0, -1.5, -1.0], [-1.0, -1.0, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    return logprobs, behavior, torch.tensor([-1.0, 1.0]), mask


def test_vetoed_tokens_get_exactly_zero_gradient_and_behavior_gets_none():
    logprobs, behavior, adv, mask = _batch()
    loss, metrics = loss_of(logprobs, behavior, adv, mask, denominator=7.0, veto_scope="suffix")
    loss.backward()
    g = logprobs.grad
    # Seq 0, suffix after kappa = 1: tokens 2 and 3 are vetoed -> exactly 0.
    assert g[0, 2] == 0 and g[0, 3] == 0
    # Token 0 of seq 0: rho = 1, A = -1, loss rho*1/7 -> d/dlogp = rho/7 = 1/7. Kappa itself is kept:
    # rho = e^-11, gradient e^-11 / 7 > 0.
    torch.testing.assert_close(g[0, 0], torch.tensor(1 / 7))
    assert g[0, 1] > 0
    # Seq 1 (A = +1): tokens 0-2 have rho = 1 -> gradient -1/7 each; token 3 is padding -> 0.
    torch.testing.assert_close(g[1], torch.tensor([-1 / 7, -1 / 7, -1 / 7, 0.0]))
    assert behavior.grad is None
    m = finalize_metrics(metrics)
    assert m["loss/veto_token_frac"] == pytest.approx(2 / 7)
    assert m["loss/veto_seq_frac"] == pytest.approx(1 / 2)
    assert m["loss/trigger_frac"] == pytest.approx(1 / 7)
    assert m["loss/first_trigger_pos"] == pytest.approx(1.0)


def test_pre_and_post_veto_normaliser():
    # 7 real tokens, 2 vetoed. Seq 1 alone (3 tokens, rho = 1, A = +1) contributes -3 to the sum.
    # Seq 0 kept tokens: t0 (rho 1, A -1) -> +1, t1 (rho e^-11) -> +e^-11.
    logprobs, behavior, adv, mask = _batch()
    total = -3 + 1 + math.exp(-11)
    pre, _ = loss_of(logprobs, behavior, adv, mask, denominator=7.0)
    post, _ = loss_of(logprobs, behavior, adv, mask, denominator=5.0, veto_normalizer="post_veto")
    assert pre.item() == pytest.approx(total / 7)
    assert post.item() == pytest.approx(total / 5)


def test_aggregation_modes_hand_computed():
    tok = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    keep = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    counts = keep.sum(1)
    # token-mean: (1 + 2 + 3) / 3 tokens = 2.
    assert aggregate(tok, keep, counts, mode="token-mean", denominator=3.0, seq_len_norm=4).item() == 2.0
    # seq-mean-token-mean: (3/2 + 3/1) / 2 sequences = 2.25.
    assert aggregate(tok, keep, counts, mode="seq-mean-token-mean", denominator=2.0, seq_len_norm=4).item() == 2.25
    # seq-mean-token-sum-norm (L = 4): (3/4 + 3/4) / 2 = 0.75.
    assert aggregate(tok, keep, counts, mode="seq-mean-token-sum-norm", denominator=2.0,
                     seq_len_norm=4).item() == 0.75


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_split_equals_one_batch(aggregation):
    torch.manual_seed(0)
    B, T = 6, 5
    logprobs = (torch.randn(B, T) * 0.3 - 1).requires_grad_(True)
    behavior = logprobs.detach() + torch.randn(B, T) * 0.5
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    mask = torch.rand(B, T) > 0.2
    mask[:, 0] = True
    den = mask.sum().float() if aggregation == "token-mean" else float(B)
    kw = dict(denominator=den, aggregation=aggregation, seq_len_norm=T, veto_scope="suffix", veto_delta=0.3)
    full, _ = loss_of(logprobs, behavior, adv, mask, **kw)
    (g_full,) = torch.autograd.grad(full, logprobs)
    parts = [loss_of(logprobs[s], behavior[s], adv[s], mask[s], **kw)[0] for s in (slice(0, 2), slice(2, 6))]
    (g_split,) = torch.autograd.grad(sum(parts), logprobs)
    torch.testing.assert_close(sum(parts), full)
    torch.testing.assert_close(g_split, g_full)


def test_m2po_tau_hand_computed():
    # Harmful tokens (A > 0, rho > 1): |log rho| = 0.1, 0.3; mean square 0.05 > budget 0.04.
    # k = 1 smallest kept: tau^2 = (2 * 0.04 - 0.01) / 1 = 0.07, between 0.1^2 and 0.3^2 -> tau = 0.264575.
    # The token with log rho = -0.5 (A > 0, rho < 1) is not harmful and is ignored.
    log_ratio = torch.tensor([[0.1, 0.3, -0.5]])
    tau = m2po_tau(log_ratio, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool), 0.04)
    assert tau.item() == pytest.approx(math.sqrt(0.07), rel=1e-5)
    # Within budget (0.1^2 = 0.01 <= 0.04): no bound.
    tau = m2po_tau(torch.tensor([[0.1, -0.5]]), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), 0.04)
    assert math.isinf(tau.item())
    # A < 0 with rho < 1 is harmful: |log rho| = 0.5, 0.5 -> mean square 0.25; tau^2 = 2*0.04/2 -> tau = 0.2.
    tau = m2po_tau(torch.tensor([[-0.5, -0.5]]), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool), 0.04)
    assert tau.item() == pytest.approx(0.2, rel=1e-5)


def test_m2po_loss_clips_harmful_tokens_at_tau():
    # tau = 0.2 from the case above: rho = e^-0.5 < e^-0.2 with A = -1 -> loss clip(rho)*1 = e^-0.2, grad 0.
    x = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    loss, m = loss_of(x, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool),
                          denominator=2.0, clip_mode="m2po", m2po_budget=0.04, veto_scope="none")
    assert loss.item() == pytest.approx(math.exp(-0.2), rel=1e-5)
    loss.backward()
    assert x.grad.abs().max() == 0
    assert finalize_metrics(m)["loss/clip_frac_low"] == 1.0


def test_k3_and_metric_finalisation():
    # k3(x) = e^x - x - 1: k3(0) = 0, k3(log 2) = 2 - 0.693147 - 1 = 0.306853.
    torch.testing.assert_close(k3(torch.tensor([0.0, math.log(2.0)])), torch.tensor([0.0, 0.3068528]))
    m = finalize_metrics({"loss/ratio_mean": torch.tensor([4.0, 2.0]), "loss/ratio_sq_mean": torch.tensor([10.0, 2.0]),
                          "loss/policy": torch.tensor([0.5, 0.0]), "loss/ratio_mean_neg": torch.tensor([0.0, 0.0])})
    # ratios {1, 3}: mean 2, mean square 5 -> ESS/n = 4 / 5.
    assert m["loss/ess_frac"] == pytest.approx(0.8)
    assert m["loss/policy"] == 0.5 and math.isnan(m["loss/ratio_mean_neg"])


def test_kl_and_entropy_terms():
    # logprobs = ref: k3 = 0 -> no change; entropy bonus subtracts coef * mean entropy.
    logprobs = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    base, _ = loss_of(logprobs, torch.zeros(1, 2), torch.tensor([1.0]), mask, denominator=2.0)
    with_terms, m = loss_of(logprobs, torch.zeros(1, 2), torch.tensor([1.0]), mask, denominator=2.0,
                                ref_logprobs=torch.zeros(1, 2), kl_beta=0.5,
                                entropy=torch.tensor([[2.0, 4.0]]), entropy_coef=0.1)
    # base = -(1 + 1)/2 = -1; entropy term -0.1 * (2 + 4)/2 = -0.3.
    assert base.item() == pytest.approx(-1.0)
    assert with_terms.item() == pytest.approx(-1.3)
    assert finalize_metrics(m)["loss/entropy"] == pytest.approx(3.0)


def test_kl_to_reference_by_hand():
    # k3(x) = exp(x) - x - 1 with x = ref - logprobs. Token 1: x = log 2 -> 2 - 0.6931 - 1 = 0.3069;
    # token 2: x = -log 2 -> 0.5 + 0.6931 - 1 = 0.1931. Mean k3 = 0.25 exactly (2.5 - 1 - 1 = 0.5 over 2).
    # Surrogate: logprobs = behaviour, so rho = 1 and the policy loss is -(1 + 1)/2 = -1.
    # Total: -1 + beta 0.5 * 0.25 = -0.875. Reversing the KL's direction (x -> -x) gives the same mean
    # here, so also check the gradient: d k3 / d logprobs = -(exp(x) - 1): -1 at token 1, +0.5 at token 2,
    # so with beta 0.5 / 2 tokens the KL adds (-0.25, +0.125) to the surrogate's (-0.5, -0.5).
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2), -1.0 - math.log(2)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    total, m = loss_of(logprobs, torch.tensor([[-1.0, -1.0]]), torch.tensor([1.0]), mask, denominator=2.0,
                           ref_logprobs=ref, kl_beta=0.5)
    assert total.item() == pytest.approx(-0.875)
    assert finalize_metrics(m)["loss/kl_ref"] == pytest.approx(0.25)
    total.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.75, -0.375]]))


def test_sequence_level_ratio_gspo_by_hand():
    # Token log-ratios (ln 2, 0): sequence log-ratio ln 2 / 2, so s = sqrt 2 = 1.41421 at both tokens.
    mask = torch.ones(1, 2, dtype=torch.bool)
    behavior = torch.zeros(1, 2)
    # Relaxed bounds [0, 5], A = 1: each token's loss is -s, token-mean over 2 tokens = -s.
    # d(-s)/d logprob_t = -s * 1/2 per token = -0.70711 for both (token-level ratios would give -1 and -0.5).
    x = torch.tensor([[math.log(2), 0.0]], requires_grad=True)
    loss, m = loss_of(x, behavior, torch.tensor([1.0]), mask, denominator=2.0, ratio_level="sequence")
    assert loss.item() == pytest.approx(-math.sqrt(2), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.full((1, 2), -math.sqrt(2) / 2))
    # Standard bounds [0.8, 1.2]: s = 1.414 > 1.2 with A > 0, so both tokens clip at 1.2: loss -1.2, no gradient.
    x = torch.tensor([[math.log(2), 0.0]], requires_grad=True)
    loss, m = loss_of(x, behavior, torch.tensor([1.0]), mask, denominator=2.0, ratio_level="sequence",
                      clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert x.grad.abs().max() == 0
    assert finalize_metrics(m)["loss/clip_frac_high"] == 1.0  # both tokens, though token 2's own ratio is 1


def test_sequence_level_ratio_is_taken_over_the_tokens_the_veto_keeps():
    # A = -1; token log-ratios (ln 1e-5, 0, ln 2): token 0 triggers (1e-5 < delta 1e-4), the suffix veto
    # drops tokens 1 and 2, so s = exp(ln 1e-5) = 1e-5 over the one kept token. Loss: -min(s * -1,
    # clip(s, 0, 5) * -1) = s = 1e-5, over the pre-veto count 3; d/d logprob_0 = s / 3; the vetoed tokens
    # get exactly zero gradient (their log-ratios are not in the mean).
    x = torch.tensor([[math.log(1e-5), 0.0, math.log(2)]], requires_grad=True)
    loss, m = loss_of(x, torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3, dtype=torch.bool),
                      denominator=3.0, ratio_level="sequence")
    assert loss.item() == pytest.approx(1e-5 / 3, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1e-5 / 3, 0.0, 0.0]]), rtol=1e-5, atol=0)
    assert finalize_metrics(m)["loss/veto_token_frac"] == pytest.approx(2 / 3)


def test_truncated_importance_weights_scale_the_surrogate_by_hand():
    # Relaxed [0, 5], token-mean over 4 tokens, veto off. rho = [[2, 1], [1, 0.5]], A = [+1, -1]:
    # surrogate [[-2, -1], [1, 0.5]]; weights [[0.5, 2], [1.5, 0.1]] -> [[-1, -2], [1.5, 0.05]],
    # sum -1.45, / 4 = -0.3625. Gradient wrt log pi (rho unclipped): -A * rho * w / 4
    # = [[-2*0.5/4, -1*2/4], [1*1.5/4, 0.5*0.1/4]] = [[-0.25, -0.5], [0.375, 0.0125]].
    behavior = torch.zeros(2, 2)
    logprobs = torch.tensor([[math.log(2.0), 0.0], [0.0, math.log(0.5)]], requires_grad=True)
    weights = torch.tensor([[0.5, 2.0], [1.5, 0.1]], requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool)
    settings = LossSettings.from_config(LossConfig(veto_scope="none"), 1)
    loss, metrics = policy_loss(LossInputs(logprobs, behavior, adv, mask, 4.0, is_weights=weights), settings)
    torch.testing.assert_close(loss, torch.tensor(-0.3625))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.5], [0.375, 0.0125]]))
    assert weights.grad is None  # the weight is a detached constant
    # Unit weights: bit-identical to no weights, loss and gradient.
    x1, x2 = (logprobs.detach().clone().requires_grad_(True) for _ in range(2))
    plain, _ = policy_loss(LossInputs(x1, behavior, adv, mask, 4.0), settings)
    ones, _ = policy_loss(LossInputs(x2, behavior, adv, mask, 4.0, is_weights=torch.ones(2, 2)), settings)
    plain.backward()
    ones.backward()
    assert plain.item() == ones.item() and x1.grad.equal(x2.grad)


def test_truncated_importance_weight_leaves_zero_advantage_tokens_inert():
    # A = 0: surrogate -min(rho * 0, clip(rho) * 0) = 0, times any weight is still 0, gradient 0.
    logprobs = torch.tensor([[0.3, -0.2]], requires_grad=True)
    settings = LossSettings.from_config(LossConfig(), 1)
    loss, _ = policy_loss(LossInputs(logprobs, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), 2.0, is_weights=torch.tensor([[2.0, 0.1]])), settings)
    loss.backward()
    assert loss.item() == 0.0 and not logprobs.grad.any()
