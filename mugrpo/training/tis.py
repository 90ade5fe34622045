"""Behaviour log-probs recomputed by the trainer, with truncated importance sampling (TIS).

``loss.behavior_logprobs=trainer`` (docs/ALGORITHM.md section 5b). The rollout engine (vLLM in
bf16, say) and the trainer compute the same weights' log-probs with different kernels and
precisions, so log pi_engine != log pi_trainer even at a stage's first update. The default
(``engine``, the paper's) takes every ratio against the engine's stored log-probs, mismatch
included. With ``trainer``:

1. at stage start, after generation and before the shard is written, the trainer recomputes the
   behaviour log-probs log pi_old with its own no-grad forward of the current (= behaviour) weights
   (:func:`recompute_trainer_logprobs`); they are persisted with the stage data, so a resumed run
   reads the same numbers;
2. the surrogate's ratio is rho = pi_theta / pi_old (trainer over trainer), and the veto sees it;
3. each token's clipped surrogate is multiplied by the detached weight
   w = min(pi_old / pi_engine, C) (:func:`tis_weights`): the samples came from pi_engine, not
   from pi_old. (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
   training"; verl ``tis_imp_ratio_cap``, TRL ``vllm_importance_sampling_cap``.)

Here: the two pure functions of that math (:func:`tis_weights`, :func:`mismatch_sums`), which
log-probs an update's ratio uses (:func:`ratio_inputs`), the stage-level mismatch metrics, and the
recompute forward (which runs the model, under FSDP2 too). The loss only receives the weights as a
tensor (``is_weights`` of :func:`mugrpo.algo.losses.policy_loss`).

Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import math

import torch

from mugrpo.training import distributed as dist
from mugrpo.training.batching import ordered_micro_batches, sequences_to_train
from mugrpo.training.data import MicroBatch, StageData, StageDataError, shard_path
from mugrpo.training.forward import response_logprobs, shared_prefix_support
from mugrpo.algo.losses import LOG_RATIO_GUARD, LossSettings, k3


def tis_weights(trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(pi_trainer / pi_engine, C) per token, detached [B, T], computed in log space.

    ``behavior_logprobs`` are the engine's (the distribution that sampled the token). E.g. log-probs
    -1.0 (trainer) and -1.5 (engine) give w = e^0.5 = 1.65 below C = 2; -0.5 and -1.5 give e^1 = 2.72,
    capped to 2. The log-ratio is clamped below at -LOG_RATIO_GUARD (a numeric guard).
    """
    d = (trainer_logprobs - behavior_logprobs).detach()
    return torch.exp(d.clamp(min=-LOG_RATIO_GUARD, max=math.log(cap)))


def mismatch_sums(trainer_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Sums over tokens (1-D inputs, real tokens only) of the engine-vs-trainer mismatch, float64 [5]:

    [ |d|, k3(d), 1(w capped), w, number of tokens ] with d = log pi_trainer - log pi_engine. k3(d) =
    e^d - d - 1 estimates KL(pi_engine || pi_trainer) from tokens sampled by the engine.
    """
    d = (trainer_logprobs - behavior_logprobs).double()
    kl = k3(d.clamp(-LOG_RATIO_GUARD, LOG_RATIO_GUARD))
    capped = (d > math.log(cap)).double()
    w = tis_weights(trainer_logprobs.double(), behavior_logprobs.double(), cap)
    return torch.stack([d.abs().sum(), kl.sum(), capped.sum(), w.sum(), torch.tensor(float(d.numel()),
                                                                                       dtype=torch.float64)])


def ratio_inputs(mb: MicroBatch, loss_cfg) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the log-probs the ratio is taken against, the TIS weights or None) for a micro-batch."""
    if loss_cfg.behavior_logprobs == "engine":
        return mb.behavior_logprobs, None
    if mb.trainer_logprobs is None:
        raise ValueError("loss.behavior_logprobs=trainer but the stage data carries no trainer log-probs")
    return mb.trainer_logprobs, tis_weights(mb.trainer_logprobs, mb.behavior_logprobs, loss_cfg.tis_cap)


def recomputed_seqs(data: StageData, cfg) -> list[int]:
    """The sequences whose behaviour log-probs the trainer recomputes: those an update can train.

    A sequence with A = 0 adds exactly nothing to the loss when no KL or entropy term is on (the
    zero-advantage skip, ``train.skip_zero_advantage``), so it needs no recompute; it keeps the
    engine's log-probs (weight 1) and stays out of the mismatch metrics.
    """
    inert = LossSettings.from_config(cfg.loss, cfg.rollout.max_new_tokens).zero_advantage_is_inert
    return sequences_to_train(data, list(range(len(data.responses))), cfg.train.skip_zero_advantage and inert)


@torch.no_grad()
def recompute_trainer_logprobs(policy, data: StageData, cfg, world, device, autocast: bool) -> StageData:
    """``data`` with ``trainer_logprobs`` filled by one no-grad forward of ``policy`` (the behaviour
    weights, in the trainer's precision and layout) over :func:`recomputed_seqs`.

    Batched like an update (shared prefix, ``schedule.micro_batch_tokens``). Under FSDP2 each rank
    computes its own shard, and every rank runs as many forwards as the busiest one (each forward
    is a collective): a rank with fewer repeats its first micro-batch and discards the result.
    """
    shared, mask_dtype, _ = shared_prefix_support(policy) if cfg.train.shared_prefix else (False, None, "")
    layout = dict(shared=shared, budget=cfg.schedule.micro_batch_tokens, max_seqs=cfg.schedule.micro_batch_size,
                  pad_id=0, mask_dtype=mask_dtype or torch.bool)
    batches = ordered_micro_batches(data, recomputed_seqs(data, cfg), **layout)
    trainer = [list(lp) for lp in data.behavior_logprobs]
    num_passes = dist.max_over_ranks(len(batches))
    filler = batches[:1] or ordered_micro_batches(data, [0], **layout)  # a rank with nothing still joins each forward
    for i in range(num_passes):
        order, mb = batches[i] if i < len(batches) else filler[0]
        logprobs, _ = response_logprobs(policy, mb.to(device), cfg.rollout.temperature, autocast, False, False)
        if i >= len(batches):
            continue
        logprobs = logprobs.float().cpu()
        for row, s in enumerate(order):
            trainer[s] = logprobs[row, :len(data.responses[s])].tolist()
    data.trainer_logprobs = trainer
    return data


def stage_metrics(data: StageData, cfg, world, stage_dir) -> dict:
    """The stage's engine-vs-trainer mismatch over the recomputed tokens, summed over ranks ({} with
    ``loss.behavior_logprobs=engine``). ``stage_dir`` names the stage's folder for the error message."""
    if cfg.loss.behavior_logprobs == "engine":
        return {}
    if data.trainer_logprobs is None:
        raise StageDataError(shard_path(stage_dir, world.rank), ValueError(
            "loss.behavior_logprobs=trainer, but this stage's data holds no trainer log-probs"))
    seqs = recomputed_seqs(data, cfg)
    flat = lambda lists: torch.tensor([v for s in seqs for v in lists[s]], dtype=torch.float32)  # noqa: E731
    sums = dist.sum_over_ranks(mismatch_sums(flat(data.trainer_logprobs), flat(data.behavior_logprobs),
                                             cfg.loss.tis_cap)).tolist()
    n = max(sums[4], 1.0)
    abs_mean = sums[0] / n
    return {"stage/engine_trainer_log_ratio_abs_mean": abs_mean, "stage/engine_trainer_kl": sums[1] / n,
            "stage/tis_capped_frac": sums[2] / n, "stage/tis_weight_mean": sums[3] / n,
            "stage/num_recomputed_tokens": int(sums[4]), "stage/engine_logprob_mismatch": abs_mean}
