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

Here: which sequences are recomputed, the recompute forward (which runs the model, under FSDP2
too, laid out and padded with filler passes by :mod:`mugrpo.kit.update`), and the stage-level
mismatch metrics. The pure math (:func:`tis_weights`, :func:`mismatch_sums`) lives in
:mod:`mugrpo.algo.importance` (re-exported here); which log-probs an update's ratio uses is
:func:`mugrpo.kit.update.ratio_inputs`. The loss only receives the weights as a tensor
(``is_weights`` of :func:`mugrpo.algo.losses.policy_loss`).

Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import torch

from mugrpo.algo.importance import mismatch_sums, tis_weights
from mugrpo.algo.losses import LossSettings
from mugrpo.kit import distributed as dist
from mugrpo.kit.batching import ordered_micro_batches
from mugrpo.stages.data import StageData, StageDataError, shard_path
from mugrpo.kit.forward import response_logprobs
from mugrpo.kit.step import with_fillers
from mugrpo.kit.update import StepSettings, ratio_inputs

__all__ = ["mismatch_sums", "ratio_inputs", "recompute_trainer_logprobs", "recomputed_seqs", "stage_metrics",
           "tis_weights"]


def recomputed_seqs(data: StageData, step: StepSettings) -> list[int]:
    """The sequences whose behaviour log-probs the trainer recomputes: those an update can train.

    A sequence with A = 0 adds exactly nothing to the loss when no KL or entropy term is on (the
    zero-advantage skip, ``train.skip_zero_advantage``), so it needs no recompute; it keeps the
    engine's log-probs (weight 1) and stays out of the mismatch metrics.
    """
    return step.to_train(data, list(range(len(data.responses))))


@torch.no_grad()
def recompute_trainer_logprobs(policy, data: StageData, step: StepSettings, device) -> StageData:
    """``data`` with ``trainer_logprobs`` filled by one no-grad forward of ``policy`` (the behaviour
    weights, in the trainer's precision and layout) over :func:`recomputed_seqs`.

    Batched like an update (shared prefix, ``schedule.micro_batch_tokens``); under FSDP2 each rank
    computes its own shard, with filler passes as an update (:func:`~mugrpo.kit.step.with_fillers`).
    """
    layout = step.layout(policy)
    batches, real = with_fillers(ordered_micro_batches(data, recomputed_seqs(data, step), **layout),
                                 lambda: ordered_micro_batches(data, [0], **layout))
    trainer = [list(lp) for lp in data.behavior_logprobs]
    for i, (order, mb) in enumerate(batches):
        logprobs, _ = response_logprobs(policy, mb.to(device), step.temperature, step.autocast, False, False)
        if i >= real:
            continue
        logprobs = logprobs.float().cpu()
        for row, s in enumerate(order):  # environment tokens (multi-turn) have no behaviour log-prob: 0, as stored
            trainer[s] = [lp if k >= 0 else 0.0
                          for lp, k in zip(logprobs[row, :len(data.responses[s])].tolist(), data.turns_of(s))]
    data.trainer_logprobs = trainer
    return data


def stage_metrics(data: StageData, step: StepSettings, world, stage_dir) -> dict:
    """The stage's engine-vs-trainer mismatch over the recomputed tokens, summed over ranks ({} with
    ``loss.behavior_logprobs=engine``). ``stage_dir`` names the stage's folder for the error message."""
    loss: LossSettings = step.loss
    if loss.behavior_logprobs == "engine":
        return {}
    if data.trainer_logprobs is None:
        raise StageDataError(shard_path(stage_dir, world.rank), ValueError(
            "loss.behavior_logprobs=trainer, but this stage's data holds no trainer log-probs"))
    seqs = recomputed_seqs(data, step)
    flat = lambda lists: torch.tensor([v for s in seqs for v, k in zip(lists[s], data.turns_of(s)) if k >= 0],  # noqa: E731
                                      dtype=torch.float32)  # policy tokens only
    sums = dist.sum_over_ranks(mismatch_sums(flat(data.trainer_logprobs), flat(data.behavior_logprobs),
                                             loss.tis_cap)).tolist()
    n = max(sums[4], 1.0)
    abs_mean = sums[0] / n
    return {"stage/engine_trainer_log_ratio_abs_mean": abs_mean, "stage/engine_trainer_kl": sums[1] / n,
            "stage/tis_capped_frac": sums[2] / n, "stage/tis_weight_mean": sums[3] / n,
            "stage/num_recomputed_tokens": int(sums[4]), "stage/engine_logprob_mismatch": abs_mean}
