"""The per-token policy loss: clipped surrogate (PPO or M2PO bounds), veto, aggregation, KL, entropy.

ALGORITHM.md sections 5-8. Every function is pure: tensors and plain scalars in, a loss and a
dict of metric tensors out. No model, no config object, no ``.item()``, no collectives.

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

import torch

from mugrpo.veto import veto_mask

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_GUARD = 20.0
"""|log rho| is clamped here before exp(): a numeric guard (rho up to 4.8e8), not a trust region."""


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, low: torch.Tensor | float,
                      high: torch.Tensor | float, dual_clip_c: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """l = -min(rho * A, clip(rho, low, high) * A), rho = exp(log_ratio) (ALGORITHM.md section 5).

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

    Harmful tokens: A > 0 with rho > 1, or A < 0 with rho < 1 (arXiv 2510.01161, as ALGORITHM.md
    section 8 states it). Returns +inf when the uncapped second moment is already within budget.
    Solved exactly: with the k smallest |log rho| left uncapped, tau^2 = (n*budget - S_k)/(n - k),
    valid when it lies between the k-th and (k+1)-th smallest values.
    """
    lr = log_ratio.detach().float()
    adv = advantages[:, None]
    harmful = mask.bool() & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
    x = torch.where(harmful, lr.abs(), torch.full_like(lr, float("inf"))).flatten().sort().values
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
    """Reduce [B, T] token losses to this micro-batch's share of the step loss.

    - ``token-mean``: sum_{i,t} l_it keep_it / denominator (denominator = tokens in the step).
    - ``seq-mean-token-mean`` (original GRPO): sum_i (sum_t l_it keep_it / n_i) / denominator
      (n_i = ``per_seq_count``, denominator = sequences in the step).
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): sum_i sum_t l_it keep_it / L / denominator with the
      constant L = ``seq_len_norm`` (max new tokens), denominator = sequences in the step.
    """
    masked = token_loss * keep
    if mode == "token-mean":
        return masked.sum() / denominator
    if mode == "seq-mean-token-mean":
        return (masked.sum(1) / per_seq_count.clamp(min=1)).sum() / denominator
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / seq_len_norm / denominator
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(p || q) per token from log(q/p) sampled under p: exp(x) - x - 1 >= 0."""
    return torch.exp(log_ratio) - log_ratio - 1


def policy_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, denominator: torch.Tensor | float, clip_mode: str = "ppo",
                clip_eps_low: float = 1.0, clip_eps_high: float = 4.0, dual_clip_c: float | None = None,
                m2po_budget: float = 0.04, veto_scope: str = "suffix", veto_delta: float = 1e-4,
                post_veto_normalizer: bool = False, aggregation: str = "token-mean", seq_len_norm: int = 1,
                ref_logprobs: torch.Tensor | None = None, kl_beta: float = 0.0,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Mu-GRPO loss of one micro-batch, and its metrics as [numerator, denominator] pairs.

    ``logprobs`` [B, T] carry the gradient; ``behavior_logprobs`` [B, T] are the stored behaviour
    log-probs (detached here: no gradient ever flows into them); ``advantages`` [B] are frozen for
    the stage. Token loss = clipped surrogate (+ kl_beta * k3(ref) - entropy_coef * H); vetoed
    tokens leave the numerator. With ``post_veto_normalizer`` the seq-mean per-sequence counts are
    post-veto (the caller then also passes a post-veto ``denominator``).
    """
    mask = mask.bool()
    fmask = mask.to(logprobs.dtype)
    log_ratio = logprobs - behavior_logprobs.detach()
    veto = veto_mask(log_ratio, advantages, mask, delta=veto_delta, scope=veto_scope)
    if clip_mode == "m2po":
        tau = m2po_tau(log_ratio, advantages, mask, m2po_budget)
        low, high = torch.exp(-tau), torch.exp(tau)
    elif clip_mode == "ppo":
        tau = None
        low, high = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    else:
        raise ValueError(f"unknown clip mode {clip_mode!r}; choose 'ppo' or 'm2po'")
    token_loss, clip_low, clip_high = clipped_surrogate(log_ratio, advantages, low, high, dual_clip_c)
    keep = mask & ~veto.vetoed
    fkeep = keep.to(logprobs.dtype)
    per_seq = (fkeep if post_veto_normalizer else fmask).sum(1)
    agg = dict(mode=aggregation, denominator=denominator, seq_len_norm=seq_len_norm)
    pg_loss = aggregate(token_loss, fkeep, per_seq, **agg)
    total = pg_loss
    lr = log_ratio.detach()
    ratio = torch.exp(lr.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD))
    n_tok = fmask.sum()
    neg, pos = (advantages < 0)[:, None] & keep, (advantages > 0)[:, None] & keep
    has_trigger = veto.first_trigger >= 0
    zero = n_tok.new_zeros(())

    def pair(num, den):
        return torch.stack([num.detach().float(), torch.as_tensor(den, dtype=torch.float32).detach()])

    metrics = {
        "loss/policy": pair(pg_loss, zero),
        "loss/clip_frac_low": pair((clip_low & mask).sum(), n_tok),
        "loss/clip_frac_high": pair((clip_high & mask).sum(), n_tok),
        "loss/veto_token_frac": pair(veto.vetoed.sum(), n_tok),
        "loss/veto_seq_frac": pair(veto.vetoed.any(1).sum(), mask.shape[0]),
        "loss/trigger_frac": pair(veto.trigger.sum(), n_tok),
        "loss/first_trigger_pos": pair(torch.where(has_trigger, veto.first_trigger, 0).sum(), has_trigger.sum()),
        "loss/ratio_mean_neg": pair((ratio * neg).sum(), neg.sum()),
        "loss/ratio_mean_pos": pair((ratio * pos).sum(), pos.sum()),
        "loss/ratio_mean": pair((ratio * fmask).sum(), n_tok),
        "loss/ratio_sq_mean": pair((ratio * ratio * fmask).sum(), n_tok),
        "loss/kl_behavior": pair((k3(lr) * fmask).sum(), n_tok),
        "loss/log_ratio_abs_mean": pair((lr.abs() * fmask).sum(), n_tok),
        "loss/num_tokens": pair(n_tok, zero),
    }
    if tau is not None:
        metrics["loss/m2po_tau"] = pair(tau.clamp(max=LOG_RATIO_GUARD), 1)
    if ref_logprobs is not None and kl_beta > 0:
        kl_tok = k3(ref_logprobs.detach() - logprobs)
        kl_loss = aggregate(kl_tok, fkeep, per_seq, **agg)
        total = total + kl_beta * kl_loss
        metrics["loss/kl_ref"] = pair((kl_tok.detach() * fmask).sum(), n_tok)
    if entropy is not None:
        if entropy_coef > 0:
            total = total - entropy_coef * aggregate(entropy, fkeep, per_seq, **agg)
        metrics["loss/entropy"] = pair((entropy.detach() * fmask).sum(), n_tok)
    metrics["loss/total"] = pair(total, zero)
    return total, metrics


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
