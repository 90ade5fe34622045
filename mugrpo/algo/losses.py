"""The per-token policy loss: clipped surrogate (PPO or M2PO bounds), veto, aggregation, KL, entropy.

docs/ALGORITHM.md sections 5-8. Every function is pure: tensors and plain values in (the loss options
as one frozen :class:`LossSettings`), a loss and a dict of metric tensors out. No model, no run
config, no ``.item()``, no collectives. The options with several implementations are registries
(:mod:`mugrpo.algo.registries`: the surrogate, the ratio level, the aggregation); a new one is a
function here plus its registry line; an off-policy correction (:mod:`mugrpo.algo.corrections`)
declares its parameters in its registry line, and both ``LossSettings`` and ``config.LossConfig``
grow them from there. Another numeric option is a field of ``LossSettings`` and of
``config.LossConfig``; the trainer passes the settings through untouched.

Shapes: B sequences, T response tokens (right-padded; ``mask`` [B, T] marks real tokens).

Metrics contract: each metric is a 2-vector ``[numerator, denominator]`` summed over micro-batches
(and ranks) by the caller and finalised by :func:`finalize_metrics` as numerator / denominator
(a denominator of 0 means "plain sum", used for the loss itself, which is already globally
normalised). This keeps every metric exact under any micro-batch or rank split.

Normaliser contract: the caller passes ``denominator``, a count over the *whole optimizer step*
(all micro-batches, all ranks): response tokens for ``token-mean``, sequences for the seq-mean
modes. The loss of a micro-batch is its share of the step's loss, so summing gradients over
micro-batches gives exactly the gradient of the one-batch loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch

from mugrpo.algo.corrections import CorrectionInputs, apply_correction
from mugrpo.algo.registries import AGGREGATORS, CORRECTIONS, RATIO_MODES, SURROGATES
from mugrpo.algo.turns import turn_metrics
from mugrpo.algo.veto import veto_mask

LOG_RATIO_GUARD = 20.0
"""|log rho| is clamped here before exp(): a numeric guard (rho up to 4.8e8), not a trust region."""


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, low: torch.Tensor | float,
                      high: torch.Tensor | float, dual_clip_c: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """l = -min(rho * A, clip(rho, low, high) * A), rho = exp(log_ratio) (docs/ALGORITHM.md section 5).

    Standard GRPO: [low, high] = [0.8, 1.2]; Mu-GRPO relaxed: [0, 5]. Under the min form a bound
    binds only on the harmful side: the low bound for A < 0 (rho < low), the high bound for A > 0
    (rho > high); a binding bound zeroes that token's gradient. With ``dual_clip_c`` the loss of
    an A < 0 token is also capped at c * |A| (dual-clip). Returns (token loss [B, T], clipped_low,
    clipped_high) where the two masks mark tokens whose bound binds.
    """
    adv = advantages[:, None].to(log_ratio.dtype)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD))
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    if dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, dual_clip_c * (-adv)), loss)
    clipped_low = (adv < 0) & (ratio < low)
    clipped_high = (adv > 0) & (ratio > high)
    return loss, clipped_low, clipped_high


def m2po_tau(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, budget: float
             ) -> torch.Tensor:
    """M2PO's bound tau: the largest tau with mean over harmful tokens of min(|log rho|, tau)^2 <= budget.

    Harmful tokens: A > 0 with rho > 1, or A < 0 with rho < 1 (arXiv 2510.01161, as docs/ALGORITHM.md
    section 8 states it). Returns +inf when the uncapped second moment is already within budget.
    Solved exactly: with the k smallest |log rho| left uncapped, tau^2 = (n*budget - S_k)/(n - k),
    valid when it lies between the k-th and (k+1)-th smallest values.
    """
    log_rho = log_ratio.detach().float()
    adv = advantages[:, None]
    harmful = mask.bool() & (((adv > 0) & (log_rho > 0)) | ((adv < 0) & (log_rho < 0)))
    x = torch.where(harmful, log_rho.abs(), torch.full_like(log_rho, float("inf"))).flatten().sort().values
    n = harmful.sum().to(torch.float32)
    sq = torch.where(torch.isfinite(x), x * x, torch.zeros_like(x))
    s_before = torch.cumsum(sq, 0) - sq  # S_k: sum of the k smallest squares
    k = torch.arange(x.numel(), device=x.device, dtype=torch.float32)
    tau2 = ((n * budget - s_before) / (n - k).clamp(min=1)).clamp(min=0)
    prev = torch.cat([x.new_zeros(1), x[:-1]])
    valid = (k < n) & (tau2 >= prev * prev) & (tau2 <= x * x)
    tau = torch.sqrt(torch.where(valid, tau2, torch.full_like(tau2, float("inf"))).min())
    within = (sq.sum() <= n * budget) | (n == 0)
    return torch.where(within, torch.full_like(tau, float("inf")), tau)


def aggregate(token_loss: torch.Tensor, keep: torch.Tensor, per_seq_count: torch.Tensor, *, mode: str,
              denominator: torch.Tensor | float, seq_len_norm: int) -> torch.Tensor:
    """Reduce [B, T] token losses to this micro-batch's share of the step loss, by the aggregation
    registered as ``mode`` (:meth:`mugrpo.algo.aggregation.Aggregation.reduce`)."""
    return AGGREGATORS.get(mode).reduce(token_loss, keep, per_seq_count, denominator=denominator,
                                        seq_len_norm=seq_len_norm)


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(p || q) per token from log(q/p) sampled under p: exp(x) - x - 1 >= 0."""
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass(frozen=True)
class LossSettings:
    """Everything :func:`policy_loss` needs besides tensors. The defaults live in
    :class:`mugrpo.config.LossConfig`; :meth:`from_config` copies its fields by name."""

    clip_mode: str
    clip_eps_low: float
    clip_eps_high: float
    dual_clip_c: float | None
    m2po_budget: float
    ratio_level: str
    veto_scope: str
    veto_delta: float
    veto_normalizer: str
    aggregation: str
    kl_beta: float
    entropy_coef: float
    correction: str
    """The off-policy correction (:data:`mugrpo.algo.registries.CORRECTIONS`); its parameters are fields
    too, added below from their declaration in the registry (``settings.opsm_delta``, ...)."""
    seq_len_norm: int
    """L of ``seq-mean-token-sum-norm`` (the run's max new tokens)."""
    behavior_logprobs: str = "engine"
    """Which stored log-probs the ratio is taken against (:func:`mugrpo.kit.update.ratio_inputs`)."""
    tis_cap: float = 2.0
    """C of the TIS weight with ``behavior_logprobs="trainer"`` (:mod:`mugrpo.stages.tis`)."""

    @classmethod
    def from_config(cls, loss_cfg, seq_len_norm: int) -> "LossSettings":
        return cls(seq_len_norm=seq_len_norm, **{f.name: getattr(loss_cfg, f.name) for f in fields(cls)
                                                 if f.name != "seq_len_norm"})

    @property
    def zero_advantage_is_inert(self) -> bool:
        """Whether a sequence with A = 0 adds exactly nothing to the loss and its gradient: its
        surrogate is -min(rho * 0, clip(rho) * 0) = 0, and no other term (KL, entropy) is on."""
        return self.kl_beta == 0 and self.entropy_coef == 0

    @property
    def post_veto(self) -> bool:
        """Whether the normaliser counts only what the veto kept (``veto_normalizer="post_veto"``)."""
        return self.veto_normalizer == "post_veto"


LossSettings = dataclasses.make_dataclass(
    "LossSettings", [(p.name, float, dataclasses.field(default=p.default)) for p in CORRECTIONS.all_params()],
    bases=(LossSettings,), frozen=True, namespace={"__module__": __name__, "__doc__": LossSettings.__doc__})


def ppo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, s: LossSettings):
    """``clip_mode="ppo"``: the clipped surrogate with [1 - eps_low, 1 + eps_high] (and dual-clip).

    Every surrogate returns (token loss [B, T], clipped_low, clipped_high, extra metric pairs)."""
    loss, low, high = clipped_surrogate(log_ratio, advantages, 1.0 - s.clip_eps_low, 1.0 + s.clip_eps_high,
                                        s.dual_clip_c)
    return loss, low, high, {}


def m2po_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, s: LossSettings):
    """``clip_mode="m2po"``: the clipped surrogate with [e^-tau, e^tau], tau = :func:`m2po_tau`."""
    tau = m2po_tau(log_ratio, advantages, mask, s.m2po_budget)
    loss, low, high = clipped_surrogate(log_ratio, advantages, torch.exp(-tau), torch.exp(tau), s.dual_clip_c)
    return loss, low, high, {"loss/m2po_tau": _pair(tau.clamp(max=LOG_RATIO_GUARD), 1)}


def token_log_ratio(log_ratio: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``ratio_level="token"``: each token's own log-ratio (PPO, GRPO)."""
    return log_ratio


def sequence_log_ratio(log_ratio: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio, mean_t log rho_t over the ``keep`` tokens, at every token [B, T].

    (Zheng et al., arXiv 2507.18071; TRL ``importance_sampling_level="sequence"``.) The gradient
    flows into every kept token's log-prob through the mean, 1 / |kept| each.
    """
    k = keep.to(log_ratio.dtype)
    mean = (log_ratio * k).sum(1, keepdim=True) / k.sum(1, keepdim=True).clamp(min=1)
    return mean.expand_as(log_ratio)


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors for :func:`policy_loss`: [B, T] each, ``advantages`` [B].

    The three log-prob names of docs/ALGORITHM.md: ``logprobs`` carry the gradient;
    ``behavior_logprobs`` are the stored behaviour log-probs (the ratio's denominator; detached by
    the loss); ``ref_logprobs`` the reference model's (the KL term, optional). ``denominator`` is
    the whole step's normaliser (the module docstring's contract). The optional fields are the
    extra terms and diagnostics; None leaves them out (:func:`metric_template` lists the keys a
    configuration can produce).
    """

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    denominator: torch.Tensor | float
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    """Per-token entropy of the current policy (logged; the bonus when ``entropy_coef > 0``)."""
    is_weights: torch.Tensor | None = None
    """A per-token weight on the clipped surrogate (detached), e.g. TIS's min(pi_trainer / pi_engine, C)."""
    turns: torch.Tensor | None = None
    """Multi-turn data: the policy turn of each token (:mod:`mugrpo.algo.turns`), for the by-turn diagnostics."""
    num_turns: int = 0
    """Buckets of the by-turn diagnostics (0: none)."""
    engine_logprobs: torch.Tensor | None = None
    """What the engine sampled with (default ``behavior_logprobs``), for the corrections."""
    trainer_logprobs: torch.Tensor | None = None
    """The trainer's recompute of the behaviour log-probs (``behavior_logprobs=trainer`` only)."""


def policy_loss(x: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Mu-GRPO loss of one micro-batch, and its metrics as [numerator, denominator] pairs.

    No gradient ever flows into the stored behaviour log-probs; the advantages are frozen for the
    stage. Token loss = clipped surrogate (+ kl_beta * k3(ref) - entropy_coef * H); vetoed tokens
    leave the numerator. With ``veto_normalizer="post_veto"`` the seq-mean per-sequence counts are
    post-veto (the caller then also passes a post-veto ``denominator``).

    ``is_weights`` multiplies the clipped surrogate only: neither the KL nor the entropy term, nor
    the normaliser. A = 0 tokens stay exactly 0 (0 * w = 0). None: the loss is exactly today's.

    ``turns`` adds the by-turn veto diagnostics over ``num_turns`` buckets
    (:func:`mugrpo.algo.turns.turn_metrics`); the loss does not change.

    ``settings.correction`` (:mod:`mugrpo.algo.corrections`, docs/ALGORITHM.md section 5c) acts after
    the veto: its mask narrows the kept tokens (the normaliser is unchanged), its weight multiplies
    the token loss (IcePop's replaces ``is_weights``), CISPO replaces the surrogate. It reads
    ``engine_logprobs`` and ``trainer_logprobs``.
    """
    logprobs, behavior_logprobs, advantages, mask = x.logprobs, x.behavior_logprobs, x.advantages, x.mask
    denominator, ref_logprobs, entropy, is_weights = x.denominator, x.ref_logprobs, x.entropy, x.is_weights
    turns, num_turns, engine_logprobs, trainer_logprobs = x.turns, x.num_turns, x.engine_logprobs, x.trainer_logprobs
    s = settings
    mask = mask.bool()
    fmask = mask.to(logprobs.dtype)
    log_ratio = logprobs - behavior_logprobs.detach()
    veto = veto_mask(log_ratio, advantages, mask, delta=s.veto_delta, scope=s.veto_scope)
    keep = mask & ~veto.vetoed
    fkeep = keep.to(logprobs.dtype)
    surrogate_log_ratio = RATIO_MODES.get(s.ratio_level)(log_ratio, keep)
    token_loss, clip_low, clip_high, extra = SURROGATES.get(s.clip_mode)(surrogate_log_ratio, advantages, mask, s)
    engine = behavior_logprobs if engine_logprobs is None else engine_logprobs
    correction = CORRECTIONS.get(s.correction)(CorrectionInputs(
        logprobs, behavior_logprobs.detach(), engine.detach(), advantages, mask,
        None if trainer_logprobs is None else trainer_logprobs.detach()), s)
    vetoed_keep = keep
    token_loss, keep = apply_correction(token_loss, logprobs, advantages, keep, correction, is_weights)
    fkeep = keep.to(logprobs.dtype)
    if correction is not None:
        extra = {**extra, **correction.metrics,
                 "loss/correction_masked_frac": _pair((vetoed_keep & ~keep).sum(), fmask.sum())}
    # the per-sequence counts follow the normaliser: post-veto at most, never post-correction
    per_seq = (vetoed_keep.to(logprobs.dtype) if s.veto_normalizer == "post_veto" else fmask).sum(1)
    agg = dict(mode=s.aggregation, denominator=denominator, seq_len_norm=s.seq_len_norm)
    pg_loss = aggregate(token_loss, fkeep, per_seq, **agg)
    total = pg_loss
    metrics = _diagnostics(log_ratio, advantages, mask, keep, veto, clip_low, clip_high)
    metrics["loss/policy"] = _pair(pg_loss, 0)
    metrics.update(extra)
    if turns is not None and num_turns > 0:
        metrics.update(turn_metrics(veto.vetoed, veto.first_trigger, mask, turns, num_turns))
    if ref_logprobs is not None and s.kl_beta > 0:
        kl_tok = k3(ref_logprobs.detach() - logprobs)
        total = total + s.kl_beta * aggregate(kl_tok, fkeep, per_seq, **agg)
        metrics["loss/kl_ref"] = _pair((kl_tok.detach() * fmask).sum(), fmask.sum())
    if entropy is not None:
        if s.entropy_coef > 0:
            total = total - s.entropy_coef * aggregate(entropy, fkeep, per_seq, **agg)
        metrics["loss/entropy"] = _pair((entropy.detach() * fmask).sum(), fmask.sum())
    metrics["loss/total"] = _pair(total, 0)
    return total, metrics


def placeholder_inputs(with_ref: bool, num_turns: int = 0) -> LossInputs:
    """A one-token :class:`LossInputs` with every optional input a configuration can have: the
    reference model's log-probs (``with_ref``), the turns (``num_turns`` > 0) and all the others."""
    one = torch.zeros(1, 1)
    return LossInputs(one, one, torch.zeros(1), one.bool(), 1.0, ref_logprobs=one if with_ref else None, entropy=one,
                      turns=one.to(torch.int8) if num_turns else None, num_turns=num_turns, engine_logprobs=one,
                      trainer_logprobs=one)


def metric_template(settings: LossSettings, with_ref: bool, num_turns: int = 0) -> dict[str, torch.Tensor]:
    """Every metric key :func:`policy_loss` can produce for this configuration, as zero
    [numerator, denominator] pairs: the one place those keys come from.

    The update starts every rank from these (whether or not the rank has sequences to train), so the
    metric all-reduce lines up; a real micro-batch's metrics are a subset (adding a key not in the
    template fails loudly). An update with nothing to train reports NaN fractions and loss 0.
    """
    _, metrics = policy_loss(placeholder_inputs(with_ref, num_turns), settings)
    return {key: torch.zeros_like(value) for key, value in metrics.items()}


def _pair(num, den) -> torch.Tensor:
    return torch.stack([torch.as_tensor(num).detach().float(), torch.as_tensor(den, dtype=torch.float32).detach()])


def _diagnostics(log_ratio, advantages, mask, keep, veto, clip_low, clip_high) -> dict[str, torch.Tensor]:
    """The per-update drift and veto diagnostics (docs/ALGORITHM.md section 10) over the micro-batch's tokens."""
    fmask = mask.to(log_ratio.dtype)
    log_rho = log_ratio.detach()
    ratio = torch.exp(log_rho.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD))
    n_tok = fmask.sum()
    neg, pos = (advantages < 0)[:, None] & keep, (advantages > 0)[:, None] & keep
    has_trigger = veto.first_trigger >= 0
    return {
        "loss/clip_frac_low": _pair((clip_low & mask).sum(), n_tok),
        "loss/clip_frac_high": _pair((clip_high & mask).sum(), n_tok),
        "loss/veto_token_frac": _pair(veto.vetoed.sum(), n_tok),
        "loss/veto_seq_frac": _pair(veto.vetoed.any(1).sum(), mask.shape[0]),
        "loss/trigger_frac": _pair(veto.trigger.sum(), n_tok),
        "loss/first_trigger_pos": _pair(torch.where(has_trigger, veto.first_trigger, 0).sum(), has_trigger.sum()),
        "loss/ratio_mean_neg": _pair((ratio * neg).sum(), neg.sum()),
        "loss/ratio_mean_pos": _pair((ratio * pos).sum(), pos.sum()),
        "loss/ratio_mean": _pair((ratio * fmask).sum(), n_tok),
        "loss/ratio_sq_mean": _pair((ratio * ratio * fmask).sum(), n_tok),
        "loss/kl_behavior": _pair((k3(log_rho) * fmask).sum(), n_tok),
        "loss/log_ratio_abs_mean": _pair((log_rho.abs() * fmask).sum(), n_tok),
        "loss/num_tokens": _pair(n_tok, 0),
    }


def finalize_metrics(summed: dict[str, torch.Tensor]) -> dict[str, float]:
    """[numerator, denominator] pairs (summed over micro-batches and ranks) -> floats.

    Adds ``loss/ess_frac`` = E[rho]^2 / E[rho^2] (effective sample size of the ratios / n).
    A fraction with an empty denominator (e.g. E[rho | A < 0] with no negative tokens) is NaN.
    """
    out = {}
    for key, (num, den) in summed.items():
        num, den = float(num), float(den)
        if key.endswith(("loss/policy", "loss/total", "loss/num_tokens")):
            out[key] = num
        else:
            out[key] = num / den if den > 0 else float("nan")
    if "loss/ratio_mean" in out and out.get("loss/ratio_sq_mean", 0) > 0:
        out["loss/ess_frac"] = out["loss/ratio_mean"] ** 2 / out["loss/ratio_sq_mean"]
    return out
