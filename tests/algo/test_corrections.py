"""Off-policy corrections (mugrpo/algo/corrections.py): hand-computed values, gradients, masked fractions.

Each test composes the correction with the relaxed clipped surrogate ([0, 5], mu-grpo's bounds) and a
token-mean over the micro-batch's tokens, as the loss does, and checks the loss value and the gradient
d loss / d log pi_theta against numbers worked out in the comments.
"""

import math

import pytest
import torch

from mugrpo.algo import corrections as C
from mugrpo.algo.losses import clipped_surrogate

pytestmark = pytest.mark.unit


def t(rows, requires_grad=False):
    return torch.tensor(rows, dtype=torch.float32, requires_grad=requires_grad)


def loss_and_grad(corr, logprobs, behavior, advantages, mask, is_weights=None, low=0.0, high=5.0):
    """Token-mean of the corrected relaxed surrogate over ALL real tokens (the denominator is never
    changed by a correction) -> (loss value, d loss / d logprobs)."""
    surrogate, _, _ = clipped_surrogate(logprobs - behavior.detach(), advantages, low, high)
    token_loss, keep = C.apply_correction(surrogate, logprobs, advantages, mask.bool(), corr, is_weights)
    loss = (token_loss * keep).sum() / mask.sum()
    (grad,) = torch.autograd.grad(loss, logprobs)
    return float(loss.detach()), grad


def frac(metric):
    num, den = metric.tolist()
    return num / den


# --- OPSM ------------------------------------------------------------------------------------------

def test_opsm_masks_a_negative_sequence_whose_mean_k1_exceeds_delta():
    # engine log-probs [-1, -2], current [-1.25, -2.5]: k1 = 0.25, 0.5, mean 0.375 (exact in binary)
    engine = t([[-1.0, -2.0], [-1.0, -2.0]])
    lp = t([[-1.25, -2.5], [-1.25, -2.5]], requires_grad=True)
    adv = t([-1.0, 1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    corr = C.opsm(lp, engine, adv, mask, delta=0.1)
    assert corr.keep.tolist() == [[False, False], [True, True]]  # A < 0 and 0.375 > 0.1; A > 0 kept
    assert frac(corr.metrics["loss/opsm_masked_seq_frac"]) == 0.5
    assert frac(corr.metrics["loss/opsm_seq_kl_mean"]) == 0.375
    # Sequence 1 (A = +1): rho = e^-0.25 = 0.778801, e^-0.5 = 0.606531, token loss -rho each (bounds [0, 5]
    # do not bind). Denominator 4 tokens (sequence 0's masked tokens still count):
    # loss = -(0.778801 + 0.606531) / 4 = -0.346333; d loss / d lp = -rho / 4 = -0.194700, -0.151633.
    value, grad = loss_and_grad(corr, lp, engine, adv, mask)
    assert value == pytest.approx(-0.346333, abs=1e-6)
    torch.testing.assert_close(grad, t([[0.0, 0.0], [-0.194700, -0.151633]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("delta, masked", [(0.1, True), (0.5, False), (0.375, False)])
def test_opsm_threshold_and_tie(delta, masked):
    # mean k1 = 0.375 (above); delta = 0.375 exactly: kept (TRL keeps kl <= delta)
    corr = C.opsm(t([[-1.25, -2.5]]), t([[-1.0, -2.0]]), t([-1.0]), torch.ones(1, 2, dtype=torch.bool), delta=delta)
    assert bool(corr.keep.any()) is not masked


def test_opsm_mean_runs_over_real_tokens_only():
    # second token is padding with a huge gap: ignored, so the mean is 0.25 -> kept at delta 0.3
    corr = C.opsm(t([[-1.25, -50.0]]), t([[-1.0, 0.0]]), t([-1.0]), torch.tensor([[True, False]]), delta=0.3)
    assert corr.keep.tolist() == [[True, False]]
    assert frac(corr.metrics["loss/opsm_masked_seq_frac"]) == 0.0


# --- IcePop -------------------------------------------------------------------------------------------

def test_icepop_weights_inside_the_band_and_drops_outside():
    # w = pi_old / pi_engine = 1.5, 3.0; first update (current = old, rho = 1), A = 1.
    engine = t([[-1.0, -1.0]])
    old = t([[-1.0 + math.log(1.5), -1.0 + math.log(3.0)]])
    lp = old.clone().requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    corr = C.icepop(old, engine, mask, low=0.5, high=2.0)
    # [0.5, 2]: weights 1.5 and 0 -> token losses -1.5, 0; token-mean over 2: -0.75; grad -1.5 / 2 = -0.75, 0
    value, grad = loss_and_grad(corr, lp, old, t([1.0]), mask)
    assert value == pytest.approx(-0.75, rel=1e-6)
    torch.testing.assert_close(grad, t([[-0.75, 0.0]]))
    assert frac(corr.metrics["loss/icepop_masked_frac"]) == 0.5
    # [0.5, 5]: weights 1.5, 3 -> (-1.5 - 3) / 2 = -2.25; grads -0.75, -1.5
    corr = C.icepop(old, engine, mask, low=0.5, high=5.0)
    value, grad = loss_and_grad(corr, lp, old, t([1.0]), mask)
    assert value == pytest.approx(-2.25, rel=1e-6)
    torch.testing.assert_close(grad, t([[-0.75, -1.5]]))
    assert frac(corr.metrics["loss/icepop_masked_frac"]) == 0.0


def test_icepop_weight_replaces_the_tis_weight():
    # with TIS weights 2 on both tokens, IcePop's own weight (1.5, 0) is still the only one: -0.75
    engine, old = t([[-1.0, -1.0]]), t([[-1.0 + math.log(1.5), -1.0 + math.log(3.0)]])
    lp, mask = old.clone().requires_grad_(True), torch.ones(1, 2, dtype=torch.bool)
    corr = C.icepop(old, engine, mask, low=0.5, high=2.0)
    value, _ = loss_and_grad(corr, lp, old, t([1.0]), mask, is_weights=t([[2.0, 2.0]]))
    assert value == pytest.approx(-0.75, rel=1e-6)
    # without a correction the TIS weight applies: -(2 + 2) / 2 = -2
    value, _ = loss_and_grad(None, lp, old, t([1.0]), mask, is_weights=t([[2.0, 2.0]]))
    assert value == pytest.approx(-2.0, rel=1e-6)


def test_icepop_drops_tokens_below_the_band():
    # w = 0.25 < 0.5: masked
    corr = C.icepop(t([[-1.0 + math.log(0.25)]]), t([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), low=0.5, high=5.0)
    assert corr.keep.tolist() == [[False]] and corr.weight.tolist() == [[0.0]]


# --- CISPO --------------------------------------------------------------------------------------------

def cispo_case(rho_log, lp_value, adv, eps_low, eps_high):
    lp = t([[lp_value]], requires_grad=True)
    behavior = t([[lp_value - rho_log]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    corr = C.cispo(lp, behavior, t([adv]), mask, eps_low=eps_low, eps_high=eps_high)
    value, grad = loss_and_grad(corr, lp, behavior, t([adv]), mask)
    return corr, value, float(grad)


def test_cispo_value_and_gradient_by_hand():
    # rho = 2, A = 1, log pi = -1: bounds [0, 5] -> weight 2, loss -2 * 1 * (-1) = +2.0, grad -2
    corr, value, grad = cispo_case(math.log(2.0), -1.0, 1.0, 1.0, 4.0)
    assert (value, grad) == (pytest.approx(2.0, rel=1e-6), pytest.approx(-2.0, rel=1e-6))
    assert frac(corr.metrics["loss/cispo_clipped_frac"]) == 0.0
    # verl's default bounds [0.8, 1.2]: weight 1.2, loss 1.2, grad -1.2
    corr, value, grad = cispo_case(math.log(2.0), -1.0, 1.0, 0.2, 0.2)
    assert (value, grad) == (pytest.approx(1.2, rel=1e-6), pytest.approx(-1.2, rel=1e-6))
    assert frac(corr.metrics["loss/cispo_clipped_frac"]) == 1.0
    # rho = 0.5, A = -1, log pi = -2: lower bound 0 -> weight 0.5, loss -0.5 * (-1) * (-2) = -1.0, grad +0.5
    corr, value, grad = cispo_case(math.log(0.5), -2.0, -1.0, 1.0, 4.0)
    assert (value, grad) == (pytest.approx(-1.0, rel=1e-6), pytest.approx(0.5, rel=1e-6))
    # lower bound 0.8: weight 0.8, loss -1.6, grad +0.8
    corr, value, grad = cispo_case(math.log(0.5), -2.0, -1.0, 0.2, 0.2)
    assert (value, grad) == (pytest.approx(-1.6, rel=1e-6), pytest.approx(0.8, rel=1e-6))


def test_cispo_trains_a_capped_token_where_ppo_would_not():
    # rho = 6 > 5, A = 1: CISPO weight 5, loss 5 * 1 = 5.0 (log pi = -1), gradient -5 ...
    corr, value, grad = cispo_case(math.log(6.0), -1.0, 1.0, 1.0, 4.0)
    assert (value, grad) == (pytest.approx(5.0, rel=1e-6), pytest.approx(-5.0, rel=1e-6))
    assert frac(corr.metrics["loss/cispo_clipped_frac"]) == 1.0
    assert frac(corr.metrics["loss/cispo_clipped_frac_pos"]) == 1.0
    # ... while the PPO surrogate with the same bounds is flat there: -min(6, 5) = -5, gradient 0
    lp = t([[-1.0]], requires_grad=True)
    value, grad = loss_and_grad(None, lp, t([[-1.0 - math.log(6.0)]]), t([1.0]), torch.ones(1, 1, dtype=torch.bool))
    assert value == pytest.approx(-5.0, rel=1e-6) and float(grad) == 0.0


# --- masked importance sampling ------------------------------------------------------------------------

def test_mis_token_masks_tokens_outside_the_band():
    # log r = 0.5, 0.7, -1: r = 1.648721, 2.013753, 0.367879; band [0.5, 2]: kept, masked, masked
    engine = t([[-1.0, -1.0, -1.0]])
    lp = t([[-0.5, -0.3, -2.0]], requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    corr = C.mis_token(lp, engine, mask, low=0.5, high=2.0)
    assert corr.keep.tolist() == [[True, False, False]]
    assert frac(corr.metrics["loss/mis_masked_frac"]) == pytest.approx(2 / 3)
    # A = 1, token loss -r; kept: first only. loss = -1.648721 / 3 = -0.549574; grad -0.549574, 0, 0
    value, grad = loss_and_grad(corr, lp, engine, t([1.0]), mask)
    assert value == pytest.approx(-0.549574, abs=1e-6)
    torch.testing.assert_close(grad, t([[-0.549574, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_mis_ratio_is_against_the_engine_not_the_surrogates_denominator():
    # with trainer log-probs the surrogate's rho may be 1 while pi_theta / pi_engine = e^0.7 = 2.01 > 2
    lp = t([[-0.3]])
    corr = C.mis_token(lp, t([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), low=0.5, high=2.0)
    assert corr.keep.tolist() == [[False]]


def test_mis_sequence_uses_the_geometric_mean():
    # seq 0: log r = 0.5, 0.7 -> mean 0.6, R = 1.822 in [0.5, 2]: kept (the product e^1.2 = 3.32 would not be)
    # seq 1: log r = 0.5, 1.0 -> mean 0.75, R = 2.117 > 2: masked, both tokens
    engine = t([[-1.0, -1.0], [-1.0, -1.0]])
    lp = t([[-0.5, -0.3], [-0.5, 0.0]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    corr = C.mis_sequence(lp, engine, mask, low=0.5, high=2.0)
    assert corr.keep.tolist() == [[True, True], [False, False]]
    assert frac(corr.metrics["loss/mis_masked_seq_frac"]) == 0.5
    assert frac(corr.metrics["loss/mis_masked_frac"]) == 0.5
    # A = 1 on both: kept tokens' loss -r; denominator 4: loss = -(1.648721 + 2.013753) / 4 = -0.915619;
    # grads -0.412180, -0.503438 on sequence 0, zero on sequence 1
    value, grad = loss_and_grad(corr, lp, engine, t([1.0, 1.0]), mask)
    assert value == pytest.approx(-0.915619, abs=1e-6)
    torch.testing.assert_close(grad, t([[-0.412180, -0.503438], [0.0, 0.0]]), atol=1e-6, rtol=0)


# --- properties every correction must keep ----------------------------------------------------------------

def all_corrections(x: C.CorrectionInputs) -> dict[str, C.Correction]:
    return {
        "opsm": C.opsm(x.logprobs, x.engine_logprobs, x.advantages, x.mask, delta=1e-4),
        "icepop": C.icepop(x.trainer_logprobs, x.engine_logprobs, x.mask, low=0.5, high=5.0),
        "cispo": C.cispo(x.logprobs, x.behavior_logprobs, x.advantages, x.mask, eps_low=1.0, eps_high=4.0),
        "mis_token": C.mis_token(x.logprobs, x.engine_logprobs, x.mask, low=0.5, high=2.0),
        "mis_sequence": C.mis_sequence(x.logprobs, x.engine_logprobs, x.mask, low=0.5, high=2.0),
    }


def random_inputs(seed: int, advantages) -> C.CorrectionInputs:
    g = torch.Generator().manual_seed(seed)
    B, T = len(advantages), 5
    engine = -torch.rand(B, T, generator=g) * 3
    trainer = engine + 0.3 * torch.randn(B, T, generator=g)
    lp = (trainer + 0.5 * torch.randn(B, T, generator=g)).requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    return C.CorrectionInputs(lp, trainer.clone().requires_grad_(True), engine.clone().requires_grad_(True),
                              torch.tensor(advantages), mask, trainer.clone().requires_grad_(True))


@pytest.mark.parametrize("name", ["opsm", "icepop", "cispo", "mis_token", "mis_sequence"])
def test_zero_advantage_stays_inert_and_stored_logprobs_get_no_gradient(name):
    x = random_inputs(0, [0.0, 0.0, 0.0])
    corr = all_corrections(x)[name]
    surrogate, _, _ = clipped_surrogate(x.logprobs - x.behavior_logprobs.detach(), x.advantages, 0.0, 5.0)
    token_loss, keep = C.apply_correction(surrogate, x.logprobs, x.advantages, x.mask, corr)
    loss = (token_loss * keep).sum()
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert float(x.logprobs.grad.abs().sum()) == 0.0
    x2 = random_inputs(1, [1.0, -1.0, 0.5])
    corr = all_corrections(x2)[name]
    surrogate, _, _ = clipped_surrogate(x2.logprobs - x2.behavior_logprobs.detach(), x2.advantages, 0.0, 5.0)
    token_loss, keep = C.apply_correction(surrogate, x2.logprobs, x2.advantages, x2.mask, corr)
    (token_loss * keep).sum().backward()
    for stored in (x2.behavior_logprobs, x2.engine_logprobs, x2.trainer_logprobs):
        assert stored.grad is None  # no gradient ever flows into the stored log-probs


@pytest.mark.parametrize("name", ["opsm", "icepop", "cispo", "mis_token", "mis_sequence"])
def test_splitting_the_batch_gives_the_same_gradient(name):
    # every correction is decided per token or per sequence, so a micro-batch split changes nothing
    x = random_inputs(2, [1.0, -1.0, 0.5, -0.5])
    denominator = x.mask.sum()

    def grad_of(rows):
        sub = C.CorrectionInputs(*(None if v is None else v[rows] for v in (
            x.logprobs, x.behavior_logprobs, x.engine_logprobs, x.advantages, x.mask, x.trainer_logprobs)))
        corr = all_corrections(sub)[name]
        surrogate, _, _ = clipped_surrogate(sub.logprobs - sub.behavior_logprobs.detach(), sub.advantages, 0.0, 5.0)
        token_loss, keep = C.apply_correction(surrogate, sub.logprobs, sub.advantages, sub.mask, corr)
        return torch.autograd.grad((token_loss * keep).sum() / denominator, x.logprobs)[0]

    whole = grad_of(slice(0, 4))
    torch.testing.assert_close(grad_of(slice(0, 2)) + grad_of(slice(2, 4)), whole)
    assert float(whole.abs().sum()) > 0  # the case is not trivially zero


# --- through the registry and the loss ------------------------------------------------------------------

def test_policy_loss_applies_the_configured_correction_and_logs_it():
    from mugrpo.algo.losses import LossInputs, LossSettings, policy_loss
    from mugrpo.config import LossConfig

    # the OPSM case above through policy_loss (relaxed clip, no veto): sequence 0 (A = -1, k1 0.375) masked;
    # loss -0.346333 as computed there, the masked tokens still in the denominator (4)
    lp = t([[-1.25, -2.5], [-1.25, -2.5]], requires_grad=True)
    engine = t([[-1.0, -2.0], [-1.0, -2.0]])
    settings = LossSettings.from_config(LossConfig(veto_scope="none", correction="opsm", opsm_delta=0.1), 2)
    loss, metrics = policy_loss(LossInputs(lp, engine, t([-1.0, 1.0]), torch.ones(2, 2, dtype=torch.bool), 4.0), settings)
    assert float(loss.detach()) == pytest.approx(-0.346333, abs=1e-6)
    assert frac(metrics["loss/opsm_masked_seq_frac"]) == 0.5
    assert frac(metrics["loss/correction_masked_frac"]) == 0.5
    # correction "none": both sequences count, -(0.778801 + 0.606531) / 4 from sequence 1 plus
    # sequence 0 (A = -1, rho as above): +(0.778801 + 0.606531) / 4 -> 0
    settings = LossSettings.from_config(LossConfig(veto_scope="none"), 2)
    loss, metrics = policy_loss(LossInputs(lp, engine, t([-1.0, 1.0]), torch.ones(2, 2, dtype=torch.bool), 4.0), settings)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6) and "loss/correction_masked_frac" not in metrics


def test_a_new_correction_is_one_registration():
    # what adding a correction takes: a function returning a Correction, registered by name; the config
    # accepts the name and the loss applies it (here: keep only the first token of every response)
    from mugrpo.algo.losses import LossInputs, LossSettings, policy_loss
    from mugrpo.algo.registries import CORRECTIONS
    from mugrpo.config import LossConfig
    from mugrpo.errors import ConfigError

    def first_token_only(x, s):
        keep = x.mask.clone()
        keep[:, 1:] = False
        return C.Correction(keep=keep, metrics={"loss/first_only_frac": C.pair(keep.sum(), x.mask.sum())})

    with pytest.raises(ConfigError, match="loss.correction"):
        LossConfig(correction="first_only").validate()
    CORRECTIONS.register("first_only", first_token_only)
    try:
        cfg = LossConfig(veto_scope="none", correction="first_only")
        cfg.validate()
        lp = t([[-1.0, -1.0]], requires_grad=True)
        # rho = 1, A = 1: token losses -1, -1; only the first kept -> -1 / 2 tokens = -0.5
        loss, metrics = policy_loss(LossInputs(lp, t([[-1.0, -1.0]]), t([1.0]), torch.ones(1, 2, dtype=torch.bool), 2.0), LossSettings.from_config(cfg, 2))
        assert float(loss.detach()) == pytest.approx(-0.5) and frac(metrics["loss/first_only_frac"]) == 0.5
    finally:
        CORRECTIONS._entries.pop("first_only")
        CORRECTIONS._loaded.pop("first_only", None)


def test_icepop_without_trainer_logprobs_is_a_config_error():
    from mugrpo.config import LossConfig
    from mugrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="loss.behavior_logprobs=trainer"):
        LossConfig(correction="icepop").validate()
    LossConfig(correction="icepop", behavior_logprobs="trainer").validate()
