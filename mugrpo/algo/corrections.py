"""Off-policy corrections: per-token masks and weights that act on the policy loss (docs/ALGORITHM.md section 5c).

Each correction is a pure function of the log-probs, the advantages and the response mask; it
returns a :class:`Correction`: which tokens it keeps in the loss's numerator, a detached weight
that multiplies the token loss, whether the surrogate is replaced by a stop-gradient-ratio one
(CISPO), and its diagnostics as ``[numerator, denominator]`` pairs (the metrics contract of
:mod:`mugrpo.algo.losses`). :func:`apply_correction` composes a correction with a token loss.
What lives elsewhere: the surrogate, the veto and the aggregation (:mod:`mugrpo.algo.losses`,
:mod:`mugrpo.algo.veto`); where each log-prob comes from (:mod:`mugrpo.stages.tis`).

The corrections (paper, peer code; details and the choices made in docs/ALGORITHM.md 5c):

- ``opsm``: off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556 Eq. 9; TRL
  ``GRPOTrainer.get_off_policy_mask``). An A < 0 response whose mean k1 log(pi_engine / pi_theta)
  over its tokens exceeds delta leaves the numerator, every token of it.
- ``icepop``: token mask on the engine-vs-trainer ratio w = pi_old / pi_engine of the behaviour
  weights (Ring-1T, arXiv 2510.18855; INTELLECT-3 arXiv 2512.16144 Eq. 1; slime ``icepop_function``):
  weight w inside [alpha, beta], 0 outside. Needs the trainer-side log-probs.
- ``cispo``: l = -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log pi_theta (MiniMax-M1, arXiv
  2506.13585 Eq. 4; TRL ``loss_type="cispo"``, SkyRL ``compute_policy_loss_cispo``).
- ``mis_token`` / ``mis_sequence``: masked importance sampling on r = pi_theta / pi_engine (the
  current policy over the distribution that sampled the token): a token (or a whole response,
  by the geometric mean of r) whose r leaves [low, high] is masked (TRL
  ``vllm_importance_sampling_mode="token_mask"/"sequence_mask"``; AReaL ``RejectionSamplingConfig``).

Every mask leaves the loss normaliser unchanged (a masked token still counts in the denominator,
as in TRL, slime and AReaL), so a firing mask never scales up the other tokens' gradients, like
the veto's default ``pre_veto``.

Shapes: B sequences, T response tokens (right-padded; ``mask`` [B, T] marks real tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LOG_RATIO_GUARD = 20.0
"""|log ratio| is clamped here before exp() (the same numeric guard as mugrpo.algo.losses)."""


@dataclass(frozen=True)
class CorrectionInputs:
    """The tensors a correction may read; none of them is modified."""

    logprobs: torch.Tensor
    """[B, T] log pi_theta, the current policy, with gradient."""
    behavior_logprobs: torch.Tensor
    """[B, T] the surrogate ratio's denominator: the engine's stored log-probs, or the trainer's
    recompute with ``loss.behavior_logprobs=trainer``."""
    engine_logprobs: torch.Tensor
    """[B, T] the log-probs the rollout engine stored while sampling (the sampling distribution)."""
    advantages: torch.Tensor
    """[B]"""
    mask: torch.Tensor
    """[B, T] bool, real response tokens."""
    trainer_logprobs: torch.Tensor | None = None
    """[B, T] log pi_old, the behaviour weights recomputed by the trainer (``loss.behavior_logprobs=trainer``)."""


@dataclass
class Correction:
    keep: torch.Tensor
    """[B, T] bool: tokens this correction keeps in the loss's numerator (inside ``mask``)."""
    weight: torch.Tensor | None = None
    """[B, T] detached weight multiplying the token loss; None: 1."""
    stop_ratio_grad: bool = False
    """True: the surrogate is replaced by -weight * A * log pi_theta (the ratio only weighs the
    token, its gradient is stopped: CISPO); the PPO clip then plays no part."""
    replaces_tis: bool = False
    """True: ``weight`` already is the engine-vs-trainer importance weight (IcePop), so the TIS weight
    of ``loss.behavior_logprobs=trainer`` is not applied on top of it."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def pair(num, den) -> torch.Tensor:
    """A metric as ``[numerator, denominator]`` (float32, detached)."""
    return torch.stack([torch.as_tensor(num).detach().float(), torch.as_tensor(den, dtype=torch.float32).detach()])


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.detach().clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of ``values`` [B, T] over ``mask`` [B, T] -> [B] (0 for an empty sequence)."""
    m = mask.to(values.dtype)
    return (values * m).sum(1) / m.sum(1).clamp(min=1)


# ---------------------------------------------------------------------------------------------
# The math, one function per correction.


def opsm(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         *, delta: float) -> Correction:
    """Off-policy sequence masking: drop response i from the numerator when A_i < 0 and

        (1/|o_i|) sum_t (log pi_engine(o_t) - log pi_theta(o_t)) > delta     (k1, mean over real tokens).

    The statistic is a comparison, so it carries no gradient (``logprobs`` detached). A sequence
    whose statistic equals delta is kept (TRL keeps ``kl <= delta``; slime masks ``kl > delta``),
    and A = 0 is kept. The denominator is untouched. E.g. log-probs -1.2, -2.4 under pi_theta
    against -1.0, -2.0 under the engine: k1 = 0.2, 0.4, mean 0.3 > delta 0.1 -> masked if A < 0.
    """
    mask = mask.bool()
    seq_kl = masked_mean(engine_logprobs.detach() - logprobs.detach(), mask)  # [B]
    masked_seq = (advantages < 0) & (seq_kl > delta) & mask.any(1)
    keep = mask & ~masked_seq[:, None]
    has = mask.any(1)
    return Correction(keep=keep, metrics={
        "loss/opsm_masked_seq_frac": pair(masked_seq.sum(), has.sum()),
        "loss/opsm_masked_token_frac": pair((mask & ~keep).sum(), mask.sum()),
        "loss/opsm_seq_kl_mean": pair((seq_kl * has).sum(), has.sum()),
    })


def icepop(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float,
           high: float) -> Correction:
    """IcePop: per token w = pi_old / pi_engine (the behaviour weights, trainer vs engine); the token
    loss is multiplied by M(w) = w if low <= w <= high, else 0 (the token leaves the numerator: no
    gradient at all). Both bounds inclusive. The weight is detached. E.g. w = 1.5, 3.0 with
    [0.5, 2.0] -> weights 1.5 and 0 (the second token is masked).
    """
    mask = mask.bool()
    log_w = (trainer_logprobs - engine_logprobs).detach()
    w = _ratio(log_w)
    inside = (log_w >= math.log(low)) & (log_w <= math.log(high))  # compared in log space, like the veto
    keep = mask & inside
    n = mask.sum()
    return Correction(keep=keep, weight=torch.where(keep, w, torch.zeros_like(w)), replaces_tis=True, metrics={
        "loss/icepop_masked_frac": pair((mask & ~inside).sum(), n),
        "loss/icepop_weight_mean": pair((w * keep).sum(), keep.sum()),
    })


def cispo(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          *, eps_low: float, eps_high: float) -> Correction:
    """CISPO: l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(o_t), rho against the
    ratio's denominator (``behavior_logprobs``). Gradient -clip(rho) * A per token: a token whose
    ratio hits a bound is still trained, with the bound as its weight (PPO's clip would zero it).
    Every token stays in the loss. Returns the weight clip(rho) with ``stop_ratio_grad``.
    E.g. rho = 2, A = 1, log pi = -1, bounds [0, 5]: weight 2, loss +2.0, d loss / d log pi = -2.
    """
    mask = mask.bool()
    rho = _ratio(logprobs - behavior_logprobs)
    low, high = max(1.0 - eps_low, 0.0), 1.0 + eps_high
    w = rho.clamp(low, high)
    clipped = mask & ((rho < low) | (rho > high))
    adv = advantages[:, None]
    n = mask.sum()
    return Correction(keep=mask, weight=w, stop_ratio_grad=True, metrics={
        "loss/cispo_clipped_frac": pair(clipped.sum(), n),
        "loss/cispo_clipped_frac_pos": pair((clipped & (adv > 0)).sum(), (mask & (adv > 0)).sum()),
        "loss/cispo_weight_mean": pair((w * mask).sum(), n),
    })


def mis_token(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float,
              high: float) -> Correction:
    """Token-level masked importance sampling on r_t = pi_theta / pi_engine: a token with r_t outside
    [low, high] (inclusive) leaves the numerator; a kept token's loss is unchanged (its surrogate
    already carries the ratio as its importance weight). Both signs of A. E.g. log r = 0.5, 0.7, -1
    with [0.5, 2]: r = 1.65, 2.01, 0.37 -> kept, masked, masked.
    """
    mask = mask.bool()
    log_r = (logprobs - engine_logprobs).detach()
    inside = (log_r >= math.log(low)) & (log_r <= math.log(high))
    keep = mask & inside
    return Correction(keep=keep, metrics={"loss/mis_masked_frac": pair((mask & ~inside).sum(), mask.sum())})


def mis_sequence(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float,
                 high: float) -> Correction:
    """Sequence-level masked importance sampling: response i leaves the numerator, every token of it,
    when its geometric-mean ratio R_i = exp(mean_t log(pi_theta / pi_engine)) is outside [low, high].

    The geometric mean, not the product (TRL's and verl's ``seq_sum_k1``): over responses of ~100
    tokens a per-token drift of 0.05 makes the product e^5, so a fixed band would mask nearly every
    response as soon as anything moves, and how much it masks would depend on length (AReaL, verl
    ``seq_mean_k1`` and GSPO use the mean). E.g. log r = 0.5, 0.7: R = e^0.6 = 1.82, kept by [0.5, 2]
    (the product e^1.2 = 3.32 would not be).
    """
    mask = mask.bool()
    mean_log_r = masked_mean((logprobs - engine_logprobs).detach(), mask)
    has = mask.any(1)
    outside = has & ((mean_log_r < math.log(low)) | (mean_log_r > math.log(high)))
    keep = mask & ~outside[:, None]
    return Correction(keep=keep, metrics={
        "loss/mis_masked_seq_frac": pair(outside.sum(), has.sum()),
        "loss/mis_masked_frac": pair((mask & ~keep).sum(), mask.sum()),
    })


# ---------------------------------------------------------------------------------------------
# Composition with the surrogate.


def apply_correction(surrogate_loss: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                     keep: torch.Tensor, correction: Correction | None, is_weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token loss [B, T], keep [B, T]) after ``correction`` (None: the surrogate times ``is_weights``).

    ``surrogate_loss`` is the clipped surrogate; ``keep`` is what the veto kept; ``is_weights`` the
    TIS weights of ``loss.behavior_logprobs=trainer`` (or None). A masking correction narrows
    ``keep`` (the aggregation then drops those tokens from the numerator; the caller's denominator
    is unchanged); a weight multiplies the token loss; a stop-gradient-ratio correction replaces the
    surrogate by -weight * A * log pi_theta. The TIS weight multiplies the result unless the
    correction's own weight replaces it (IcePop). A = 0 tokens stay exactly 0 in every case.
    """
    token_loss = surrogate_loss
    if correction is not None:
        keep = keep & correction.keep
        if correction.stop_ratio_grad:
            adv = advantages[:, None].to(logprobs.dtype)
            token_loss = -correction.weight.detach().to(logprobs.dtype) * adv * logprobs
        elif correction.weight is not None:
            token_loss = token_loss * correction.weight.detach().to(token_loss.dtype)
    if is_weights is not None and not (correction is not None and correction.replaces_tis):
        token_loss = token_loss * is_weights.detach().to(token_loss.dtype)
    return token_loss, keep


# ---------------------------------------------------------------------------------------------
# Registry entries (:data:`mugrpo.algo.registries.CORRECTIONS`): ``entry(x: CorrectionInputs, s) ->
# Correction | None`` with ``s`` the loss settings (:class:`mugrpo.algo.losses.LossSettings`, which
# carries the ``loss.*`` parameters by name).


def no_correction(x: CorrectionInputs, s) -> None:
    """``loss.correction=none``: the loss of sections 5-7, untouched."""
    return None


def opsm_entry(x: CorrectionInputs, s) -> Correction:
    """``loss.correction=opsm``: :func:`opsm` against the engine's log-probs, delta ``loss.opsm_delta``."""
    return opsm(x.logprobs, x.engine_logprobs, x.advantages, x.mask, delta=s.opsm_delta)


def icepop_entry(x: CorrectionInputs, s) -> Correction:
    """``loss.correction=icepop``: :func:`icepop` on [``loss.icepop_low``, ``loss.icepop_high``]."""
    if x.trainer_logprobs is None:
        raise ValueError("loss.correction=icepop needs the trainer's log-probs (loss.behavior_logprobs=trainer)")
    return icepop(x.trainer_logprobs, x.engine_logprobs, x.mask, low=s.icepop_low, high=s.icepop_high)


def cispo_entry(x: CorrectionInputs, s) -> Correction:
    """``loss.correction=cispo``: :func:`cispo` with ``loss.cispo_eps_low`` / ``loss.cispo_eps_high``."""
    return cispo(x.logprobs, x.behavior_logprobs, x.advantages, x.mask, eps_low=s.cispo_eps_low,
                 eps_high=s.cispo_eps_high)


def mis_token_entry(x: CorrectionInputs, s) -> Correction:
    """``loss.correction=mis_token``: :func:`mis_token` on [``loss.mis_low``, ``loss.mis_high``]."""
    return mis_token(x.logprobs, x.engine_logprobs, x.mask, low=s.mis_low, high=s.mis_high)


def mis_sequence_entry(x: CorrectionInputs, s) -> Correction:
    """``loss.correction=mis_sequence``: :func:`mis_sequence` on [``loss.mis_low``, ``loss.mis_high``]."""
    return mis_sequence(x.logprobs, x.engine_logprobs, x.mask, low=s.mis_low, high=s.mis_high)
