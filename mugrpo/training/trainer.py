"""The staged Mu-GRPO loop (docs/ALGORITHM.md section 3), one code path for every preset.

Each stage: push weights to the engine (the stage's only sync) -> generate every prompt of the
stage once, with behaviour log-probs -> score -> group advantages -> persist the stage dataset ->
release the engine -> mu optimizer updates on the static data, ratios always against the STORED
behaviour log-probs. ``grpo`` is this loop with mu = 4. With ``schedule.adaptive`` a stage may end
before mu updates when a drift guard trips (:mod:`mugrpo.algo.adaptive`); the run always ends after
``total_updates``. With ``rollout.dynamic_sampling`` the generation phase runs in rounds
and keeps the informative groups (:mod:`mugrpo.algo.dynamic`, :mod:`mugrpo.stages.generation`).

Here: :func:`train` (the loop) and :class:`Trainer`, the one owner of a run's machinery (policy,
optimizer, scheduler, world, plan, resolved precision, reference model, the rollout parts, logger,
progress, run state), whose methods are the loop's steps: one optimizer update, a stage's end, a
checkpoint. Its components are built from the parts they need, not from the trainer: the stage
source that gives each stage's data (:mod:`mugrpo.stages.sources`: generated, single-turn or
trajectories, in one round or dynamic rounds, or replayed) and the evaluator
(:mod:`mugrpo.training.evaluator`).

What lives elsewhere: the math (:mod:`mugrpo.algo.losses`, :mod:`mugrpo.algo.veto`,
:mod:`mugrpo.algo.advantages`); the trainer kit RL shares with the warm start (:mod:`mugrpo.kit`:
the accumulate-and-step of :mod:`mugrpo.kit.step`, the update's layout and normaliser in
:mod:`mugrpo.kit.update`, the run's lifecycle, checkpoints, FSDP2); the schedule arithmetic
(:mod:`mugrpo.config.plan`); how a stage's data is made and kept (:mod:`mugrpo.stages`); engines
(:mod:`mugrpo.rollout.engines`). A warm start before RL is run above this module
(:mod:`mugrpo.pipeline`), which never imports the warm start. The layers: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mugrpo.algo.adaptive import end_reason, stage_length
from mugrpo.algo.losses import LossInputs, LossSettings, finalize_metrics, metric_template, policy_loss
from mugrpo.config import Config, ConfigError
from mugrpo.config.plan import Plan, format_plan, make_plan
from mugrpo.models import lora
from mugrpo.observability.loggers import NullLogger, make_logger
from mugrpo.observability.progress import Progress
from mugrpo.rollout.envs.build import (build_env_factory, describe_env, format_rows, start_tool_workers,
                                       turn_budget_rows)
from mugrpo.rollout.tasks import Task, build_task, longest_prompt_tokens
from mugrpo.faults import maybe_die, should_poison
from mugrpo.hardware import Resolved, detect, resolve
from mugrpo.kit import distributed as dist
from mugrpo.kit.checkpoint import RunState
from mugrpo.kit.forward import response_logprobs, shared_prefix_support
from mugrpo.kit.lifecycle import RunLifecycle
from mugrpo.kit.model_parts import ModelParts, TrainingError, build_model, build_optimizer  # noqa: F401
from mugrpo.kit.step import accumulate, check_some_steps_applied, device_batches, step_optimizer
from mugrpo.kit.update import StepSettings, normaliser, ratio_inputs
from mugrpo.rollout.engines import build_engine
from mugrpo.run_dir import RunDir
from mugrpo.stages import ahead
from mugrpo.stages import replay as replay_mod
from mugrpo.stages.data import StageData
from mugrpo.stages.samplers import RolloutParts
from mugrpo.stages.shards import rank_update_groups
from mugrpo.stages.sources import StageSource, build_stage_source, build_store
from mugrpo.stopping import Interrupted
from mugrpo.training.evaluator import TrainingEvaluator


MAX_TURN_BUCKETS = 8
"""At most this many ``loss/veto_token_frac_turn{k}`` keys per update (the last: that turn and later)."""


# ---------------------------------------------------------------------------------------------
# The loop.


def train(cfg: Config, life: RunLifecycle, task: Task | None = None, replay: str | Path | None = None,
          model_path: str | None = None) -> Path:
    """Run (or resume) the RL run that ``life`` holds; returns the final model folder. The run's kind,
    its warm start and its directory's claim are decided above (:func:`mugrpo.pipeline.train`).

    ``task``: one built from data given in Python (:func:`mugrpo.api.train`); else ``cfg.task``'s.
    ``replay``: a run directory whose stages this run trains on instead of generating its own
    (:mod:`mugrpo.stages.replay`; a resumed run replays the source it recorded). ``model_path``: the
    model to start from instead of ``model.name`` (a warm start's final model)."""
    world, rd = life.world, life.run_dir
    plan = make_plan(cfg, world.size)
    if life.resume and replay is not None:
        raise replay_mod.ReplayError("--replay starts a new run; a resumed run replays the source it recorded "
                                     f"({rd.replay}): drop --replay")
    source = replay_mod.check_source(replay, cfg, world.size) if replay is not None else None
    resolved = resolve(cfg.train.autocast, cfg.rollout.dtype, cfg.rollout.engine, detect())
    if life.resume:  # a resumed replay keeps replaying the source it recorded (checked when a stage is copied)
        source = replay_mod.recorded_source(rd.path)
    trainer = Trainer.build(cfg, plan, world, resolved, task, rd, replay=source, model_path=model_path)
    trainer.life = life
    maybe_die("model_loaded")
    life.close_at_exit(trainer.close)
    if life.resume:
        trainer.resume()
    else:
        life.stop_point()  # a stop while the model loaded: a new run has written nothing yet
        life.claim()  # (a new run: only now that model, task and engine have loaded, so a failed start leaves nothing)
        if source is not None and world.is_main:
            replay_mod.record_source(rd.path, source)
    life.stop_point()  # a stop during the start: nothing trained yet, the resume starts here
    trainer.start()
    stopper = life.stopper
    trainer.evaluator.stopper = stopper
    trainer.evaluator.maybe_run(trainer.state)  # the initial policy (eval.at_start)
    life.stop_point()  # a stop that abandoned the starting evaluation: the resume runs it
    while trainer.state.update < plan.total_updates:  # by updates: adaptive stages vary in number
        data, stage_metrics = trainer.source.stage(trainer.state, stopper)
        reason, optimize_s = trainer.optimise_stage(data, stage_metrics)
        if reason is None:  # stopped mid-stage, checkpointed
            raise Interrupted(rd.path)
        trainer.end_stage(reason, data, stage_metrics, optimize_s)
        # (at the last stage too, when a stop abandoned its evaluation: the resume runs it, then exports)
        more = trainer.state.update < plan.total_updates or trainer.state.eval_pending
        if more and life.after_step(trainer.state.update, None)[0]:
            raise Interrupted(rd.path)
    return trainer.finish()


def step_settings(cfg: Config, resolved: Resolved | None = None) -> StepSettings:
    """The update step's settings (:mod:`mugrpo.kit.update`): the one place they are read from the
    config. ``resolved`` defaults to the HF engine's resolution of the config for this machine."""
    resolved = resolved or resolve(cfg.train.autocast, cfg.rollout.dtype, "hf", detect())
    return StepSettings(loss=LossSettings.from_config(cfg.loss, cfg.rollout.max_new_tokens),
                        temperature=cfg.rollout.temperature, autocast=resolved.autocast == "bf16",
                        skip_zero_advantage=cfg.train.skip_zero_advantage, shared_prefix=cfg.train.shared_prefix,
                        micro_batch_tokens=cfg.schedule.micro_batch_tokens,
                        micro_batch_size=cfg.schedule.micro_batch_size)


@dataclass(eq=False)
class Trainer:
    """One run's machinery and state; the loop (:func:`train`) calls its steps.

    Built by :meth:`build` for a run, or directly from parts (a policy, an optimizer, a scheduler)
    to run single updates (:meth:`update`), as the tests and benchmarks do. ``resolved`` defaults to
    the HF engine's resolution of the config for this machine.
    """

    cfg: Config
    plan: Plan
    world: Any
    policy: torch.nn.Module
    optimizer: Any
    scheduler: Any
    device: Any = "cpu"
    resolved: Resolved | None = None
    ref_model: Any = None
    parts: RolloutParts | None = None
    """The rollout engine, task, tokenizer and environment factory (None: single updates only)."""
    source: StageSource | None = None
    """Where each stage's data comes from (:mod:`mugrpo.stages.sources`)."""
    run_dir: RunDir | None = None
    state: RunState = field(default_factory=RunState)
    logger: Any = field(default_factory=NullLogger)
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    evaluator: Any = None
    t_start: float = field(default_factory=time.perf_counter)
    step: StepSettings = field(init=False)
    ckpt_s: float = 0.0
    """Checkpoint seconds inside the current stage's wall-clock interval (from the previous stage
    record to this one, so the previous stage-end checkpoint counts here)."""

    life: RunLifecycle | None = None
    """The run's lifecycle: resume, checkpoints, export (None: single updates only)."""

    def __post_init__(self):
        cfg = self.cfg
        self.resolved = self.resolved or resolve(cfg.train.autocast, cfg.rollout.dtype, "hf", detect())
        self.step = step_settings(cfg, self.resolved)

    @classmethod
    def build(cls, cfg: Config, plan: Plan, world, resolved: Resolved, task: Task | None, run_dir: RunDir,
              replay=None, model_path: str | None = None) -> "Trainer":
        """Load the model, tokenizer, reference model, optimizer, task and engine for a run, and build
        its stage source (``replay``: the stages of another run, :mod:`mugrpo.stages.sources`).
        ``model_path``: the model to start from instead of ``model.name`` (a warm start's final model)."""
        m = build_model(cfg, plan, world, model_path=model_path)
        policy, tokenizer, model_path = m.policy, m.tokenizer, m.model_path
        task = task or build_task(cfg.task)
        env_factory = build_env_factory(cfg.task, cfg.env, task)
        if (line := start_tool_workers(cfg.task, cfg.env)) and world.is_main:  # before any step's clock starts
            print(line)
        if env_factory is None and cfg.task.reward_fn == "none":
            raise ConfigError("task.reward_fn=none leaves nothing to score: it is for an environment that scores "
                              "itself (task.env / task.tools); set task.env, or a task.reward_fn")
        # The longest prompt sizes the vLLM CPU KV cache (rollout.vllm.kv_cache_gb: auto); an environment's grow.
        longest = longest_prompt_tokens(task, tokenizer, cfg.task) if env_factory is None else None
        engine = build_engine(resolved, model_path, tokenizer, cfg.rollout, seed=cfg.train.seed, prompt_tokens=longest)
        engine = ahead.shared_engine(engine, cfg.schedule.async_stages)  # async: generation and evaluation take turns
        parts = RolloutParts(engine, task, tokenizer, env_factory)
        progress = Progress(enabled=cfg.train.progress and world.is_main)
        trainer = cls(cfg, plan, world, policy, m.optimizer, m.scheduler, device=m.device, resolved=resolved,
                      ref_model=m.ref_model, parts=parts, run_dir=run_dir, progress=progress)
        store = build_store(cfg, world, parts, run_dir, trainer.step)
        if cfg.schedule.async_stages:  # stages generated ahead, in a thread (mugrpo.stages.ahead)
            trainer.source = ahead.build_ahead_source(cfg, plan, world, parts, policy, store, replay)
        else:
            trainer.source = build_stage_source(cfg, plan, world, parts, policy, store, progress, replay)
        return trainer

    def resume(self) -> None:
        """Load the newest checkpoint (if any) into the policy, optimizer, scheduler and state."""
        self.state = self.life.resume_state(self.policy, self.optimizer, self.scheduler, self.cfg.eval)

    def start(self) -> None:
        """Open the logger, print the plan (and what the environment is, as ``mugrpo plan`` says it), and
        set up evaluation."""
        cfg, world = self.cfg, self.world
        self.logger = make_logger(cfg, self.run_dir.path) if world.is_main else NullLogger()
        if world.is_main:
            print(format_plan(self.plan, cfg, self.resolved))
            # From the start-up check's first environment (build_env_factory): no environment is made for it.
            summary = getattr(self.parts.env_factory, "summary", None) if self.parts is not None else None
            print(format_rows(describe_env(summary) + turn_budget_rows(
                summary, self.parts.tokenizer if summary else None, cfg.rollout.max_new_tokens, cfg.env)), end="")
            for note in self.resolved.notes + _layout_notes(self.policy, cfg):
                print(f"[mugrpo] {note}")
        self.t_start = time.perf_counter() - self.state.elapsed_s
        self.evaluator = TrainingEvaluator(cfg, self.plan, world, self.parts, self.policy, self.logger, self.progress,
                                           clock=lambda: time.perf_counter() - self.t_start)

    def save(self) -> float:
        """Checkpoint now; returns the seconds it took."""
        return self.life.save(self.policy, self.optimizer, self.scheduler, self.state, self.t_start)

    def log(self, kind: str, metrics: dict, update_in_stage: int) -> None:
        s = self.state
        self.logger.log({"kind": kind, "stage": s.stage, "update": s.update, "update_in_stage": update_in_stage,
                         "time_s": time.perf_counter() - self.t_start, **metrics})

    def optimise_stage(self, data: StageData, stage_metrics: dict) -> tuple[str | None, float]:
        """The stage's updates, until it ends (returns why) or a stop is requested (returns None, after a
        checkpoint); also the optimisation seconds, checkpoints and in-loop evaluations excluded."""
        cfg, plan, state = self.cfg, self.plan, self.state
        t_opt, ckpt_in_opt_s = time.perf_counter(), 0.0
        max_length = stage_length(plan.updates_per_stage, plan.total_updates, state.update - state.update_in_stage)
        bar = self.progress.bar(max_length, f"stage {state.stage} optimise", initial=state.update_in_stage)
        reason = None  # why the stage ends, decided after each update and before any checkpoint
        while reason is None:
            t_update = time.perf_counter()
            metrics = self.update(data)
            state.update += 1
            state.update_in_stage += 1
            metrics.update({"perf/update_s": time.perf_counter() - t_update,
                            "stage/staleness": state.update_in_stage - 1})
            if state.update_in_stage == 1:  # in the checkpoint: a resume past this update still has it
                value = metrics.get("loss/log_ratio_abs_mean")
                state.stage_first_log_ratio = None if value is None else float(value)
            reason = end_reason(cfg.schedule, metrics, state.update_in_stage, plan.updates_per_stage, max_length)
            self.log("update", metrics, update_in_stage=state.update_in_stage - 1)
            self.progress.update(bar, metrics)
            maybe_die("update")
            self.evaluator.maybe_run(state, stage_ends=reason is not None)
            interrupted, due = self.life.after_step(state.update_in_stage, cfg.checkpoint.every_updates)
            if (due or interrupted) and reason is None:  # a stage's end is checkpointed by end_stage
                seconds = self.save()
                self.ckpt_s += seconds
                ckpt_in_opt_s += seconds
            if interrupted:
                break
        self.progress.close(bar)
        return reason, time.perf_counter() - t_opt - self.evaluator.in_loop_s - ckpt_in_opt_s

    def end_stage(self, reason: str, data: StageData, stage_metrics: dict, optimize_s: float) -> None:
        """Log the stage record, move to the next stage and checkpoint its start."""
        state = self.state
        # With trainer log-probs already set at the stage's start (mugrpo.stages.tis).
        stage_metrics.setdefault("stage/engine_logprob_mismatch", state.stage_first_log_ratio)
        stage_metrics.update(_stage_end_metrics(reason, state, data, self.plan, self.world))
        stage_metrics["perf/optimize_s"] = optimize_s
        stage_metrics["perf/eval_s"] = self.evaluator.finish_stage(state)
        stage_metrics["perf/checkpoint_s"] = self.ckpt_s
        stage_metrics.update(getattr(self.source, "stage_end_metrics", dict)())  # async: idle fractions (ahead.py)
        self.log("stage", stage_metrics, update_in_stage=state.update_in_stage)
        if self.world.is_main:
            self.progress.stage_summary(state.stage, stage_metrics)
        state.stage += 1
        state.update_in_stage = 0
        state.stage_first_log_ratio = None
        self.ckpt_s = self.save()

    def finish(self) -> Path:
        """Check the run changed the policy, and export the final model; returns its folder."""
        check_some_steps_applied(self.state, "updates", "Check the rewards (reward/num_invalid, "
                                 "stages/*/rollouts.jsonl), lower optim.lr, or turn off train.autocast")
        if self.cfg.train.save_final_model:
            return self.life.export(self.policy, self.parts.tokenizer)
        return self.run_dir.final_model

    def close(self) -> None:
        engine = self.parts.engine if self.parts is not None else None
        # The source first: stages generated ahead stop their thread before the engine closes.
        for close in (getattr(self.source, "close", None), self.logger.close, engine and engine.close):
            if close:
                close()

    # -----------------------------------------------------------------------------------------
    # Optimisation phase.

    def update(self, data: StageData) -> dict:
        """One optimizer update on this update's minibatch of the stage data; returns finalised metrics.

        Only the sequences that can move the update are computed (:mod:`mugrpo.kit.batching`):
        zero-advantage sequences are skipped when no loss term depends on them, each group's prompt is
        encoded once, and micro-batches are cut by tokens. The normaliser still counts every sequence
        of the update (:func:`mugrpo.kit.update.normaliser`).
        """
        state, world, step, device = self.state, self.world, self.step, self.device
        groups = rank_update_groups(data, self.plan.prompts_per_update // world.size, state.update_in_stage,
                                    self.cfg.train.seed, state.stage)
        seqs = [g * data.group_size + j for g in groups for j in range(data.group_size)]
        trained = step.to_train(data, seqs)
        batches, real = device_batches(data, trained, seqs[:1], step.layout(self.policy), device)
        denominator = normaliser(self.policy, data, seqs, trained, batches, real, step)
        denominator = dist.sum_over_ranks(denominator.to(device)).clamp(min=1)
        summed = metric_template(step.loss, with_ref=self.ref_model is not None, num_turns=self.num_turn_buckets)
        summed["loss/trained_seq_frac"] = torch.tensor([float(len(trained)), float(len(seqs))])
        poison = should_poison("loss")  # test hook: makes this update's loss NaN

        def micro_loss(mb):
            loss, metrics = self._micro_batch_loss(mb, denominator)
            return (loss * float("nan") if poison else loss), metrics

        for metrics in accumulate(self.policy, batches, real, world, micro_loss):
            for key, value in metrics.items():
                summed[key] = summed[key] + value.cpu()
        if not batches and poison:  # nothing to compute (every sequence has A = 0): the hook poisons the metric
            summed["loss/total"] = summed["loss/total"] * float("nan")
        return self._optimizer_step(dist.sum_metrics(summed))

    def _micro_batch_loss(self, mb, denominator) -> tuple[torch.Tensor, dict]:
        step = self.step
        logprobs, entropy = response_logprobs(self.policy, mb, step.temperature, step.autocast, True,
                                              step.loss.entropy_coef > 0)
        ref_logprobs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logprobs, _ = response_logprobs(self.ref_model, mb, step.temperature, step.autocast, False, False)
        old_logprobs, is_weights = ratio_inputs(mb, step.loss)
        return policy_loss(LossInputs(logprobs, old_logprobs, mb.advantages, mb.response_mask, denominator,
                                      ref_logprobs=ref_logprobs, entropy=entropy, is_weights=is_weights,
                                      turns=mb.turns, num_turns=self.num_turn_buckets,
                                      engine_logprobs=mb.behavior_logprobs, trainer_logprobs=mb.trainer_logprobs),
                           step.loss)

    @property
    def num_turn_buckets(self) -> int:
        """By-turn veto diagnostics: turns 0 .. K - 2 each, then K - 1 and later; 0 without an environment."""
        multi_turn = self.parts is not None and self.parts.env_factory is not None
        return min(self.cfg.env.max_turns, MAX_TURN_BUCKETS) if multi_turn else 0

    def _optimizer_step(self, summed: dict) -> dict:
        """Clip, step (or skip a non-finite update), and finalise the update's metrics."""
        loss_value = float(summed["loss/total"][0])
        out = finalize_metrics(summed)
        out.update(step_optimizer(self.policy, self.optimizer, self.scheduler, self.state,
                                  self.cfg.optim.max_grad_norm, self.cfg.checkpoint.max_bad_updates, loss_value))
        return out


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
