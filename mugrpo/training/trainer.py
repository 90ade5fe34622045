"""The staged Mu-GRPO loop (docs/ALGORITHM.md section 3), one code path for every preset.

Each stage: push weights to the engine (the stage's only sync) -> generate every prompt of the
stage once, with behaviour log-probs -> score -> group advantages -> persist the stage dataset ->
release the engine -> mu optimizer updates on the static data, ratios always against the STORED
behaviour log-probs. ``grpo`` is this loop with mu = 4. With ``schedule.adaptive`` a stage may end
before mu updates when a drift guard trips (:mod:`mugrpo.algo.adaptive`); the run always ends after
``total_updates``.

What lives elsewhere: the math (:mod:`mugrpo.algo.losses`, :mod:`mugrpo.algo.veto`,
:mod:`mugrpo.algo.advantages`), the schedule arithmetic (:mod:`mugrpo.config.plan`), persistence of stage
data (:mod:`mugrpo.training.data`), the optional trainer-side behaviour log-probs with TIS
(:mod:`mugrpo.training.tis`), checkpoints (:mod:`mugrpo.training.checkpoint`), engines (:mod:`mugrpo.rollout.engines`), and
multi-process concerns (:mod:`mugrpo.training.distributed`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from mugrpo.training import checkpoint as ckpt
from mugrpo.training import data as data_files
from mugrpo.training import distributed as dist
from mugrpo.models import lora
from mugrpo.training import seeds
from mugrpo.training import tis
from mugrpo.algo.adaptive import end_reason, stage_length
from mugrpo.algo.advantages import group_advantages, zero_variance_groups
from mugrpo.training.batching import micro_batches, sequences_to_train
from mugrpo.training.checkpoint import RunState
from mugrpo.config import Config
from mugrpo.training.data import StageData, write_stage_text
from mugrpo.rollout.engines import SamplingConfig, make_engine, weights_loaded
from mugrpo.errors import UserError
from mugrpo.evaluation.evaluate import TrainingEvaluator
from mugrpo.training.faults import maybe_die, should_poison
from mugrpo.training.forward import response_logprobs, shared_prefix_support
from mugrpo.training.hardware import Resolved, detect, resolve
from mugrpo.algo.losses import LossSettings, finalize_metrics, policy_loss
from mugrpo.observability.loggers import NullLogger, make_logger
from mugrpo.models.loading import check_context, load_policy, load_tokenizer, resolve_model_path
from mugrpo.config.plan import Plan, format_plan, make_plan
from mugrpo.observability.progress import Progress
from mugrpo.rollout.rewards import per_reward_counts, per_reward_metrics
from mugrpo.rollout.tasks import Task, build_task, limit_prompts, prompt_ids
from mugrpo.algo.veto import veto_mask


class TrainingError(UserError, RuntimeError):
    """Training cannot continue (e.g. too many non-finite updates in a row); the message says why."""


# ---------------------------------------------------------------------------------------------
# The loop.


def train(cfg: Config, run_dir: Path, resume: bool = False, task: Task | None = None) -> Path:
    """Run (or resume) a training run in ``run_dir``; returns the final model folder.

    ``task``: one built from data given in Python (:func:`mugrpo.api.train`); else ``cfg.task``'s."""
    run_dir = Path(run_dir)
    world = dist.init(cfg.parallel.timeout_s)
    plan = make_plan(cfg, world.size)
    resolved = resolve(cfg.train.autocast, cfg.rollout.dtype, cfg.rollout.engine, detect())
    lock = engine = logger = stopper = None
    failed_new_run, existed = False, run_dir.is_dir()
    if resume:  # before any work: a second process on this run directory stops here
        ckpt.prepare_run_dir(run_dir, cfg, resume, is_main=world.is_main)
        lock = ckpt.lock_run_dir(run_dir, world)
    else:
        ckpt.check_run_dir_free(run_dir)
    try:
        _configure_torch(cfg)
        model_path = resolve_model_path(cfg.model.name, cfg.model.cache_dir) if world.is_main else None
        model_path = dist.broadcast_object(model_path)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)  # checks its vocab against the model
        check_context(model_path, cfg, cfg.model.trust_remote_code)
        policy = lora.apply_lora(load_policy(model_path, cfg.model.trust_remote_code), cfg.lora)
        ref_model = load_policy(model_path, cfg.model.trust_remote_code).eval() if cfg.loss.kl_beta > 0 else None
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        policy, device = dist.prepare_model(policy, cfg, world)
        if ref_model is not None:
            ref_model = dist.prepare_frozen(ref_model, cfg, world)
        optimizer, scheduler = build_optimizer(policy, cfg, plan)
        task = task or build_task(cfg.task)
        engine = make_engine(resolved.engine, model_path, tokenizer,
                             dataclasses.replace(cfg.rollout, dtype=resolved.engine_dtype), seed=cfg.train.seed)
        state = RunState()
        if resume:
            if world.is_main:
                for path in ckpt.remove_stale_temporaries(run_dir):
                    print(f"[mugrpo] removed {path}, left by an interrupted write")
            state = ckpt.load_latest(run_dir, policy, optimizer, scheduler, world) or RunState()
            if world.is_main:
                ckpt.truncate_metrics(run_dir / "metrics.jsonl", state)
        else:
            # Only now that model, task and engine have loaded: a failed start leaves no run directory.
            ckpt.prepare_run_dir(run_dir, cfg, resume, is_main=world.is_main)
            lock = ckpt.lock_run_dir(run_dir, world)
        logger = make_logger(cfg, run_dir) if world.is_main else NullLogger()
        progress = Progress(enabled=cfg.train.progress and world.is_main)
        if world.is_main:
            print(format_plan(plan, cfg, resolved))
            for note in resolved.notes + _layout_notes(policy, cfg):
                print(f"[mugrpo] {note}")
        t_start = time.perf_counter() - state.elapsed_s
        evaluator = TrainingEvaluator(cfg, plan, task, tokenizer, engine, policy, logger, world, progress, t_start)
        stopper = ckpt.GracefulStop()

        def save() -> float:
            t = time.perf_counter()
            ckpt.save(run_dir, policy, optimizer, scheduler, state, cfg, world, elapsed_s=t - t_start)
            return time.perf_counter() - t

        # Checkpoint seconds inside the current stage's wall-clock interval (which runs from the previous
        # stage record to this one, so the previous stage-end checkpoint counts here), and those inside
        # the optimisation phase (taken off perf/optimize_s).
        ckpt_s, ckpt_in_opt_s = 0.0, 0.0
        evaluator.maybe_run(state)  # the initial policy (eval.at_start)
        while state.update < plan.total_updates:  # by updates: adaptive stages vary in number
            stage_dir = data_files.stage_dir(run_dir, state.stage)
            data, stage_metrics = load_or_generate_stage(state, stage_dir, policy, engine, task, tokenizer,
                                                         cfg, plan, world, progress, stopper, resolved)
            t_opt = time.perf_counter()
            max_length = stage_length(plan.updates_per_stage, plan.total_updates, state.update - state.update_in_stage)
            bar = progress.bar(max_length, f"stage {state.stage} optimise", initial=state.update_in_stage)
            reason = None  # why the stage ends, decided after each update and before any checkpoint
            while reason is None:
                t_update = time.perf_counter()
                metrics = optimizer_update(policy, optimizer, scheduler, data, state, cfg, plan, world, device,
                                           ref_model, resolved)
                state.update += 1
                state.update_in_stage += 1
                metrics.update({"perf/update_s": time.perf_counter() - t_update, "stage/staleness":
                                state.update_in_stage - 1})
                if state.update_in_stage == 1:  # with trainer log-probs: set at stage start (mugrpo.training.tis)
                    stage_metrics.setdefault("stage/engine_logprob_mismatch", metrics.get("loss/log_ratio_abs_mean"))
                reason = end_reason(cfg.schedule, metrics, state.update_in_stage, plan.updates_per_stage, max_length)
                logger.log(_record("update", state, t_start, metrics, update_in_stage=state.update_in_stage - 1))
                progress.update(bar, metrics)
                maybe_die("update")
                evaluator.maybe_run(state, stage_ends=reason is not None)
                interrupted = stopper.requested
                due = cfg.checkpoint.every_updates and state.update_in_stage % cfg.checkpoint.every_updates == 0
                if (due or interrupted) and reason is None:  # a stage's end is checkpointed below
                    seconds = save()
                    ckpt_s += seconds
                    ckpt_in_opt_s += seconds
                if interrupted:
                    break
            progress.close(bar)
            if reason is None:  # stopped mid-stage, checkpointed above
                raise ckpt.Interrupted(run_dir)
            stage_metrics.update(_stage_end_metrics(reason, state, data, plan, world))
            stage_metrics["perf/optimize_s"] = time.perf_counter() - t_opt - evaluator.in_loop_s - ckpt_in_opt_s
            stage_metrics["perf/eval_s"] = evaluator.finish_stage(state)
            stage_metrics["perf/checkpoint_s"] = ckpt_s
            logger.log(_record("stage", state, t_start, stage_metrics, update_in_stage=state.update_in_stage))
            if world.is_main:
                progress.stage_summary(state.stage, stage_metrics)
            state.stage += 1
            state.update_in_stage = 0
            ckpt_s, ckpt_in_opt_s = save(), 0.0
            if stopper.requested and state.update < plan.total_updates:
                raise ckpt.Interrupted(run_dir)
        if state.update and state.num_skipped_updates >= state.update:
            raise TrainingError(f"all {state.update} updates of this run were skipped for a non-finite loss or "
                                "gradient, so the policy never changed; no final model was written. Check the "
                                "rewards (reward/num_invalid, stages/*/rollouts.jsonl), lower optim.lr, or turn "
                                "off train.autocast")
        final = run_dir / "final_model"
        if cfg.train.save_final_model:
            ckpt.export_hf(policy, tokenizer, final, world)
        return final
    except Exception as exc:
        # The run dir is this run's own (locked, found empty); an interrupted run keeps it, to be resumed.
        failed_new_run = not (resume or isinstance(exc, ckpt.Interrupted)) and lock is not None
        raise
    finally:
        for close in (stopper and stopper.restore, logger and logger.close, engine and engine.close,
                      lock and lock.close):
            if close:
                close()
        if failed_new_run and ckpt.discard_failed_start(run_dir, keep_dir=existed):
            print(f"[mugrpo] removed what this run wrote in {run_dir}: it failed before writing anything to resume "
                  "from, so the corrected command can be run again")


def _stage_end_metrics(reason: str, state: RunState, data: StageData, plan: Plan, world) -> dict:
    """How the stage ended (:mod:`mugrpo.algo.adaptive`) and how much of its data the updates drew:
    ``stage/passes_used`` = prompt groups drawn / groups in the stage (below 1: some never used)."""
    num_groups = float(dist.sum_over_ranks(torch.tensor([float(data.num_groups)]))[0])
    return {"stage/end_reason": reason, "stage/ended_early": float(reason in ("kl", "neg_ratio")),
            "stage/num_updates": state.update_in_stage,
            "stage/passes_used": state.update_in_stage * plan.prompts_per_update / max(num_groups, 1.0)}


def _layout_notes(policy, cfg: Config) -> list[str]:
    notes = [lora.describe(policy)] if lora.has_lora(policy) else []
    if not cfg.train.shared_prefix:
        return notes
    supported, _, reason = shared_prefix_support(policy)
    return notes + ([] if supported else [f"note: train.shared_prefix falls back to the unshared forward: {reason}"])


def _record(kind: str, state: RunState, t_start: float, metrics: dict, update_in_stage: int) -> dict:
    return {"kind": kind, "stage": state.stage, "update": state.update, "update_in_stage": update_in_stage,
            "time_s": time.perf_counter() - t_start, **metrics}


def _configure_torch(cfg: Config) -> None:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.train.seed)


def build_optimizer(policy: torch.nn.Module, cfg: Config, plan: Plan):
    o = cfg.optim
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr,
                                  betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)

    def factor(step: int) -> float:
        if o.warmup_updates and step < o.warmup_updates:
            return (step + 1) / o.warmup_updates
        progress = (step - o.warmup_updates) / max(1, plan.total_updates - o.warmup_updates)
        if o.lr_schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if o.lr_schedule == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------
# Generation phase.


def load_or_generate_stage(state: RunState, stage_dir: Path, policy, engine, task, tokenizer, cfg: Config,
                           plan: Plan, world, progress, stopper=None, resolved: Resolved | None = None
                           ) -> tuple[StageData, dict]:
    """The stage's data: read back if persisted (resume), else sync -> generate -> score -> [recompute
    the behaviour log-probs with the trainer (``loss.behavior_logprobs=trainer``)] -> persist."""
    data = dist.load_stage_shards(stage_dir, world)
    if data is not None:
        return data, {"stage/resumed": 1.0, **_stage_stats(data, world), **tis.stage_metrics(data, cfg, world,
                                                                                              stage_dir)}
    indices, prompts = _stage_prompts(state, task, tokenizer, cfg, plan, world)
    r = cfg.rollout
    t0 = time.perf_counter()
    with weights_loaded(engine, dist.full_state_items(policy)):
        t_sync = time.perf_counter()
        sampling = SamplingConfig(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_new_tokens=r.max_new_tokens,
                                  seed=seeds.rollout_sampling(cfg.train.seed, state.stage, world.rank))
        bar = progress.bar(len(prompts) * r.group_size, f"stage {state.stage} generate", unit="seq")
        def on_batch(n: int) -> None:
            progress.advance(bar, n)
            maybe_die("generate")
            if stopper is not None and stopper.requested:  # the last checkpoint is this stage's start
                raise ckpt.Interrupted(stage_dir.parent.parent)

        completions = engine.generate(prompts, sampling, progress=on_batch)
        progress.close(bar)
    t_gen = time.perf_counter()
    flat = [c for group in completions for c in group]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat]
    items = [task.items[i] for i in indices for _ in range(r.group_size)]
    rewards, score_stats = task.score_all(texts, items)
    rewards = rewards.view(len(prompts), r.group_size)
    advantages, zero_var = group_advantages(rewards, std_scale=cfg.loss.adv_std_scale, eps=cfg.loss.adv_eps)
    data = StageData(prompts, [c.token_ids for c in flat], [c.behavior_logprobs for c in flat],
                     rewards.flatten(), advantages.flatten(),
                     torch.tensor([c.finish_reason == "stop" for c in flat]), indices, r.group_size)
    stats = _stage_stats(data, world)
    if bool(zero_var.all()) and world.is_main:
        print(f"[mugrpo] warning: stage {state.stage}: every group has zero reward variance, so every advantage "
              "is 0 and this stage's policy-gradient updates are zero. If this persists, the task is too hard or "
              "too easy for the model (see stages/*/rollouts.jsonl)")
    if cfg.loss.drop_zero_var_groups and not bool(zero_var.all()):  # all-zero: keep them (zero gradient)
        data = data.subset([g for g in range(data.num_groups) if not zero_var[g]])
    stats["stage/num_groups_trained"] = data.num_groups
    t_score = time.perf_counter()
    if cfg.loss.behavior_logprobs == "trainer":
        resolved = resolved or resolve(cfg.train.autocast, cfg.rollout.dtype, "hf", detect())
        data = tis.recompute_trainer_logprobs(policy, data, cfg, world, dist.train_device(world),
                                              resolved.autocast == "bf16")
        stats.update(tis.stage_metrics(data, cfg, world, stage_dir))
        stats["perf/recompute_s"] = time.perf_counter() - t_score
    dist.save_stage_shard(data, stage_dir, world)
    if cfg.train.save_stage_text:
        write_stage_text(data_files.text_path(stage_dir, world.rank, world.size), data, tokenizer, task.items)
    if score_stats.first_error and world.is_main:
        print(f"[mugrpo] warning: the reward function raised {score_stats.num_errors} time(s) in stage "
              f"{state.stage} (scored 0); first traceback:\n{score_stats.first_error}")
    num_new = sum(len(c.token_ids) for c in flat)
    names = [r.name for r in task.rewards] if len(task.rewards) > 1 or cfg.task.rewards else []
    counts = dist.sum_over_ranks(torch.tensor([
        score_stats.num_errors, score_stats.num_timeouts, score_stats.num_invalid, score_stats.num_unparsable,
        score_stats.num_scored, plan.prompts_per_stage // world.size - len(prompts),
        *per_reward_counts(score_stats, names)], dtype=torch.float64)).tolist()
    num_failed = int(counts[0] + counts[1] + counts[2])
    if num_failed and num_failed == int(counts[4]) * len(task.rewards) and world.is_main:
        print(f"[mugrpo] warning: stage {state.stage}: all {num_failed} rewards failed and scored 0 "
              f"({int(counts[0])} errors, {int(counts[1])} timeouts, {int(counts[2])} invalid values), so nothing "
              "is learned from this stage. Check task.reward_fn / task.rewards (any traceback is printed above), "
              "task.reward_timeout_s, and that the scorer returns a finite number")
    stats.update({
        "perf/sync_s": t_sync - t0, "perf/generate_s": t_gen - t_sync, "perf/score_s": t_score - t_gen,
        "perf/generate_tok_s": num_new / max(t_gen - t_sync, 1e-9),
        "reward/num_errors": int(counts[0]), "reward/num_timeouts": int(counts[1]),
        "reward/num_invalid": int(counts[2]), "reward/unparsable_frac": counts[3] / max(counts[4], 1),
        "stage/num_prompts_skipped": int(counts[5]),
        **per_reward_metrics(names, counts[6:], counts[4]),
    })
    return data, stats


def _stage_prompts(state: RunState, task, tokenizer, cfg: Config, plan: Plan, world) -> tuple[list[int], list]:
    """This rank's share of the stage's prompt draw (whole groups), tokenised, the length rule applied."""
    gen = torch.Generator().manual_seed(seeds.prompt_draw(cfg.train.seed, state.stage))
    indices = dist.generation_share(task.sample(plan.prompts_per_stage, gen), world)
    prompts = [prompt_ids(tokenizer, task.items[i].prompt, cfg.task) for i in indices]
    prompts, kept = limit_prompts(prompts, cfg.task, "training")
    return [indices[i] for i in kept], prompts


def _stage_stats(data: StageData, world) -> dict:
    lengths = torch.tensor([len(r) for r in data.responses], dtype=torch.float32)
    rewards = dist.gather_cat(data.rewards)
    return {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
        "stage/response_len_mean": dist.mean_over_ranks(lengths.sum(), lengths.numel()),
        "stage/truncated_frac": dist.mean_over_ranks((~data.finished).float().sum(), lengths.numel()),
        "stage/num_sequences": int(rewards.numel()),
        "stage/num_groups": int(rewards.numel()) // data.group_size,
        "stage/zero_var_group_frac": float(zero_variance_groups(rewards.view(-1, data.group_size)).float().mean()),
    }


# ---------------------------------------------------------------------------------------------
# Optimisation phase.


def optimizer_update(policy, optimizer, scheduler, data: StageData, state: RunState, cfg: Config, plan: Plan,
                     world, device, ref_model=None, resolved: Resolved | None = None) -> dict:
    """One optimizer update on this update's minibatch of the stage data; returns finalised metrics.

    Only the sequences that can move the update are computed (:mod:`mugrpo.training.batching`): zero-advantage
    sequences are skipped when no loss term depends on them, each group's prompt is encoded once,
    and micro-batches are cut by tokens. The normaliser still counts every sequence of the update.
    """
    resolved = resolved or resolve(cfg.train.autocast, cfg.rollout.dtype, "hf", detect())
    autocast = resolved.autocast == "bf16"
    groups = dist.rank_update_groups(data, plan.prompts_per_update // world.size, state.update_in_stage,
                                     cfg.train.seed, state.stage)
    G, lc = data.group_size, cfg.loss
    seqs = [g * G + j for g in groups for j in range(G)]
    settings = LossSettings.from_config(lc, cfg.rollout.max_new_tokens)
    skip = cfg.train.skip_zero_advantage and settings.zero_advantage_is_inert
    trained = sequences_to_train(data, seqs, skip)
    shared, mask_dtype, _ = shared_prefix_support(policy) if cfg.train.shared_prefix else (False, None, "")
    layout = dict(shared=shared, budget=cfg.schedule.micro_batch_tokens, max_seqs=cfg.schedule.micro_batch_size,
                  pad_id=0, mask_dtype=mask_dtype or torch.bool)
    batches = [b.to(device) for b in micro_batches(data, trained, **layout)]
    real = len(batches)
    # Under FSDP2 every rank must run as many forward/backward passes as the busiest one (each is a
    # collective); a rank with fewer repeats a real micro-batch (or builds one) with its loss times 0.
    num_passes = dist.max_over_ranks(real)
    if real < num_passes:
        filler = batches[:1] or [b.to(device) for b in micro_batches(data, seqs[:1], **layout)]
        batches += filler * (num_passes - real)
    denominator = _denominator(policy, data, seqs, trained, batches, real, cfg, autocast)
    denominator = dist.sum_over_ranks(denominator.to(device)).clamp(min=1)
    summed = _zero_metrics(settings, with_ref=ref_model is not None)
    summed["loss/trained_seq_frac"] = torch.tensor([float(len(trained)), float(len(seqs))])
    poison = should_poison("loss")  # test hook: makes this update's loss NaN
    for i, mb in enumerate(batches):
        with dist.no_sync_unless_last(policy, i == len(batches) - 1):
            logprobs, entropy = response_logprobs(policy, mb, cfg.rollout.temperature, autocast, True,
                                                  lc.entropy_coef > 0)
            ref_logprobs = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_logprobs, _ = response_logprobs(ref_model, mb, cfg.rollout.temperature, autocast, False, False)
            old_logprobs, is_weights = tis.ratio_inputs(mb, lc)
            loss, metrics = policy_loss(logprobs, old_logprobs, mb.advantages, mb.response_mask, settings,
                                        denominator=denominator, ref_logprobs=ref_logprobs, entropy=entropy,
                                        is_weights=is_weights)
            if poison:
                loss = loss * float("nan")
            if i >= real:  # a filler pass: the collectives run, nothing is added
                loss = loss * 0.0
            # DDP/FSDP average gradients over ranks; the loss is already a share of the global sum.
            (loss * world.size).backward()
        if i < real:
            for key, value in metrics.items():
                summed[key] = summed[key] + value.cpu()
    if not batches:
        # Nothing to compute (every sequence has A = 0): the gradient is exactly zero, as the plain
        # path's would be, and AdamW still steps (moments decay, weight decay applies).
        _zero_grads(policy)
        if poison:
            summed["loss/total"] = summed["loss/total"] * float("nan")
    return _step(policy, optimizer, scheduler, dist.sum_metrics(summed), state, cfg)


def _step(policy, optimizer, scheduler, summed: dict, state: RunState, cfg: Config) -> dict:
    """Clip, step (or skip a non-finite update), and finalise the update's metrics."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    loss_value = float(summed["loss/total"][0])
    out = finalize_metrics(summed)
    out["optim/lr"] = scheduler.get_last_lr()[0]
    out["optim/grad_norm"] = grad_norm
    if not (math.isfinite(grad_norm) and math.isfinite(loss_value)):
        optimizer.zero_grad(set_to_none=True)
        state.bad_update_streak += 1
        state.num_skipped_updates += 1
        out["optim/skipped"] = 1.0
        print(f"[mugrpo] warning: update {state.update} skipped: non-finite loss ({loss_value}) or gradient "
              f"norm ({grad_norm}); {state.bad_update_streak} in a row")
        if state.bad_update_streak >= cfg.checkpoint.max_bad_updates:
            raise TrainingError(f"{state.bad_update_streak} consecutive updates had a non-finite loss or gradient. "
                                "Check the data (see stages/*/rollouts.jsonl); a lower optim.lr or "
                                "train.autocast=none needs a new run (--resume keeps the run's optimizer settings)")
    else:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.bad_update_streak = 0
        out["optim/skipped"] = 0.0
    scheduler.step()
    out["optim/num_skipped_updates"] = state.num_skipped_updates
    return out


def _zero_metrics(settings: LossSettings, with_ref: bool) -> dict[str, torch.Tensor]:
    """Every metric key of :func:`policy_loss`, as zero [numerator, denominator] pairs.

    Every rank starts from the same keys, whether or not it has sequences to train, so the
    metric all-reduce lines up; an update with nothing to train reports NaN fractions and loss 0.
    """
    one = torch.zeros(1, 1)
    _, metrics = policy_loss(one, one, torch.zeros(1), one.bool(), settings, denominator=1.0,
                             ref_logprobs=one if with_ref else None, entropy=one)
    return {key: torch.zeros_like(value) for key, value in metrics.items()}


def _zero_grads(policy) -> None:
    for p in policy.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _denominator(policy, data: StageData, seqs: list[int], trained: list[int], batches, real: int, cfg: Config,
                 autocast: bool) -> torch.Tensor:
    """This rank's share of the update's loss normaliser, counted over ALL of ``seqs``, skipped ones included.

    token-mean: response tokens; seq-mean modes: sequences. With ``loss.veto_normalizer=post_veto``
    the vetoed tokens (or wholly vetoed sequences) leave the count, which takes one extra no-grad
    forward of the trained micro-batches (the veto needs the current log-probs). A skipped
    sequence has A = 0, which the veto never touches, so it counts in full. ``batches`` beyond the
    first ``real`` are filler passes (FSDP2 collectives): run, not counted.
    """
    token_mean = cfg.loss.aggregation == "token-mean"
    if cfg.loss.veto_normalizer != "post_veto":
        return torch.tensor(float(sum(len(data.responses[s]) for s in seqs) if token_mean else len(seqs)))
    trained_set = set(trained)
    skipped = [len(data.responses[s]) for s in seqs if s not in trained_set]
    kept_skipped = sum(skipped) if token_mean else sum(n > 0 for n in skipped)  # like keep.any(1) below
    return torch.tensor(float(kept_skipped + _kept_after_veto(policy, batches, real, cfg, autocast, token_mean)))


@torch.no_grad()
def _kept_after_veto(policy, batches, real: int, cfg: Config, autocast: bool, token_mean: bool) -> float:
    kept = 0.0
    for i, mb in enumerate(batches):
        logprobs, _ = response_logprobs(policy, mb, cfg.rollout.temperature, autocast, False, False)
        if i >= real:
            continue
        veto = veto_mask(logprobs - tis.ratio_inputs(mb, cfg.loss)[0], mb.advantages, mb.response_mask,
                         delta=cfg.loss.veto_delta, scope=cfg.loss.veto_scope)
        keep = mb.response_mask & ~veto.vetoed
        kept += float(keep.sum()) if token_mean else float(keep.any(1).sum())
    return kept
