"""The staged Mu-GRPO loop (docs/ALGORITHM.md section 3), one code path for every preset.

Each stage: push weights to the engine (the stage's only sync) -> generate every prompt of the
stage once, with behaviour log-probs -> score -> group advantages -> persist the stage dataset ->
release the engine -> mu optimizer updates on the static data, ratios always against the STORED
behaviour log-probs. ``grpo`` is this loop with mu = 4. With ``schedule.adaptive`` a stage may end
before mu updates when a drift guard trips (:mod:`mugrpo.algo.adaptive`); the run always ends after
``total_updates``. With ``rollout.dynamic_sampling`` the generation phase runs in rounds
and keeps the informative groups (:mod:`mugrpo.algo.dynamic`, :mod:`mugrpo.stages.generation`).

Here: :func:`train` (an RL run, from its parts to its final model) and :class:`Trainer`, the one owner
of a run's machinery (policy, optimizer, scheduler, world, plan, resolved precision, reference model,
the rollout parts, logger, progress, run state: :class:`~mugrpo.stages.state.RLState`). It is the RL
:class:`~mugrpo.kit.lifecycle.Phase`: the run's lifecycle owns the order (claim, resume, the loop
around the step with its checkpoints and stops, the export); the trainer's methods are what that
order calls: one step (the stage's data at its start, then one optimizer update), a stage's end. Its
components are built from the parts they need, not from the trainer: the stage source that gives each
stage's data (:mod:`mugrpo.stages.sources`: generated, single-turn or
trajectories, in one round or dynamic rounds, or replayed) and the evaluator
(:mod:`mugrpo.training.evaluator`).

What lives elsewhere: the math (:mod:`mugrpo.algo.losses`, :mod:`mugrpo.algo.veto`,
:mod:`mugrpo.algo.advantages`); the trainer kit RL shares with the warm start (:mod:`mugrpo.kit`:
the accumulate-and-step of :mod:`mugrpo.kit.step`, the update's layout and normaliser in
:mod:`mugrpo.kit.update`, the run's lifecycle, checkpoints, FSDP2); the schedule arithmetic
(:mod:`mugrpo.config.plan`); how a stage's data is made and kept, and RL's position in a run
(:mod:`mugrpo.stages`); engines
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
from mugrpo.kit.forward import response_logprobs, shared_prefix_support
from mugrpo.kit.lifecycle import PhaseRun
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
from mugrpo.stages.state import RLState, kept_after_resume
from mugrpo.training.evaluator import TrainingEvaluator


MAX_TURN_BUCKETS = 8
"""At most this many ``loss/veto_token_frac_turn{k}`` keys per update (the last: that turn and later)."""


# ---------------------------------------------------------------------------------------------
# The RL phase of a run.


def train(cfg: Config, run: PhaseRun, task: Task | None = None, replay: str | Path | None = None,
          model_path: str | None = None) -> Path:
    """Run (or resume) the RL phase of the run that ``run`` holds; returns the final model folder. The run's
    kind and its warm start are decided above (:func:`mugrpo.pipeline.train`); the order of the phase's
    steps is the lifecycle's (:meth:`mugrpo.kit.lifecycle.PhaseRun.run`).

    ``task``: one built from data given in Python (:func:`mugrpo.api.train`); else ``cfg.task``'s.
    ``replay``: a run directory whose stages this run trains on instead of generating its own
    (:mod:`mugrpo.stages.replay`; a resumed run replays the source it recorded). ``model_path``: the
    model to start from instead of ``model.name`` (a warm start's final model)."""
    world, rd = run.world, run.run_dir
    plan = make_plan(cfg, world.size)
    if run.resume and replay is not None:
        raise replay_mod.ReplayError("--replay starts a new run; a resumed run replays the source it recorded "
                                     f"({rd.replay}): drop --replay")
    source = replay_mod.check_source(replay, cfg, world.size) if replay is not None else None
    resolved = resolve(cfg.train.autocast, cfg.rollout.dtype, cfg.rollout.engine, detect())
    if run.resume:  # a resumed replay keeps replaying the source it recorded (checked when a stage is copied)
        source = replay_mod.recorded_source(rd.path)
    trainer = Trainer.build(cfg, plan, world, resolved, task, rd, replay=source, model_path=model_path)
    trainer.replay_source = None if run.resume else source
    return run.run(trainer)


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
    state: RLState = field(default_factory=RLState)
    logger: Any = field(default_factory=NullLogger)
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    evaluator: Any = None
    t_start: float = field(default_factory=time.perf_counter)
    settings: StepSettings = field(init=False)
    """The update step's settings (:func:`step_settings`)."""
    run: PhaseRun | None = None
    """The lifecycle context the phase runs in (None: single updates only)."""
    replay_source: Any = None
    """A new replay run's source, recorded in the run directory once it is claimed."""
    current_stage: Any = None
    """The current stage: its data and metrics, and the clocks of its optimisation (None between stages)."""
    ckpt_mark: float = 0.0
    """The run's checkpoint seconds at the previous stage record: a stage's ``perf/checkpoint_s`` is the
    checkpoint time since (so the previous stage-end checkpoint counts in the next stage)."""

    def __post_init__(self):
        cfg = self.cfg
        self.resolved = self.resolved or resolve(cfg.train.autocast, cfg.rollout.dtype, "hf", detect())
        self.settings = step_settings(cfg, self.resolved)

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
        store = build_store(cfg, world, parts, run_dir, trainer.settings)
        if cfg.schedule.async_stages:  # stages generated ahead, in a thread (mugrpo.stages.ahead)
            trainer.source = ahead.build_ahead_source(cfg, plan, world, parts, policy, store, replay)
        else:
            trainer.source = build_stage_source(cfg, plan, world, parts, policy, store, progress, replay)
        return trainer

    # -----------------------------------------------------------------------------------------
    # The phase, as the lifecycle runs it (mugrpo.kit.lifecycle.PhaseRun.run).

    @property
    def total_steps(self) -> int:
        return self.plan.total_updates  # by updates: adaptive stages vary in number

    @property
    def checkpoint_every(self) -> int:
        return self.cfg.checkpoint.every_updates

    def checkpointed(self) -> tuple:
        return self.policy, self.optimizer, self.scheduler

    def kept_after_resume(self, record: dict) -> bool:
        return kept_after_resume(self.cfg.eval, self.state)(record)

    def on_claim(self) -> None:
        if self.replay_source is not None and self.world.is_main:
            replay_mod.record_source(self.run_dir.path, self.replay_source)

    def start(self, run: PhaseRun) -> None:
        """Open the logger, print the plan (and what the environment is, as ``mugrpo plan`` says it), set up
        evaluation and evaluate the initial policy (``eval.at_start``; a resumed run: what it evaluates again)."""
        cfg, world = self.cfg, self.world
        self.run = run
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
        self.evaluator.stopper = run.stopper
        self.evaluator.maybe_run(self.state)  # the initial policy (eval.at_start)

    def log(self, kind: str, metrics: dict, update_in_stage: int) -> None:
        s = self.state
        self.logger.log({"kind": kind, "stage": s.stage, "update": s.update, "update_in_stage": update_in_stage,
                         "time_s": time.perf_counter() - self.t_start, **metrics})

    def step(self) -> bool:
        """One optimizer update, logged, with the in-loop evaluation; at a stage's start, the stage's data
        first. True when the update ends the stage (why: ``self.stage.reason``, :mod:`mugrpo.algo.adaptive`)."""
        cfg, plan, state = self.cfg, self.plan, self.state
        if self.current_stage is None:
            self.current_stage = self._begin_stage()
        st = self.current_stage
        t_update = time.perf_counter()
        metrics = self.update(st.data)
        state.update += 1
        state.update_in_stage += 1
        metrics.update({"perf/update_s": time.perf_counter() - t_update,
                        "stage/staleness": state.update_in_stage - 1})
        if state.update_in_stage == 1:  # in the checkpoint: a resume past this update still has it
            value = metrics.get("loss/log_ratio_abs_mean")
            state.stage_first_log_ratio = None if value is None else float(value)
        st.reason = end_reason(cfg.schedule, metrics, state.update_in_stage, plan.updates_per_stage, st.max_length)
        self.log("update", metrics, update_in_stage=state.update_in_stage - 1)
        self.progress.update(st.bar, metrics)
        maybe_die("update")
        self.evaluator.maybe_run(state, stage_ends=st.reason is not None)
        return st.reason is not None

    def _begin_stage(self) -> "_Stage":
        state, plan = self.state, self.plan
        data, metrics = self.source.stage(state, self.run.stopper)
        max_length = stage_length(plan.updates_per_stage, plan.total_updates, state.update - state.update_in_stage)
        bar = self.progress.bar(max_length, f"stage {state.stage} optimise", initial=state.update_in_stage)
        return _Stage(data, metrics, max_length, bar, time.perf_counter(), self.run.checkpoint_s)

    def end_unit(self) -> None:
        """The stage's end: log the stage record (with the optimisation seconds, checkpoints and in-loop
        evaluations excluded) and move to the next stage (checkpointed next by the lifecycle)."""
        st, state = self.current_stage, self.state
        self.progress.close(st.bar)
        optimize_s = (time.perf_counter() - st.t_opt - self.evaluator.in_loop_s
                      - (self.run.checkpoint_s - st.checkpoint_s_at_start))
        stage_metrics = st.metrics
        # With trainer log-probs already set at the stage's start (mugrpo.stages.tis).
        stage_metrics.setdefault("stage/engine_logprob_mismatch", state.stage_first_log_ratio)
        stage_metrics.update(_stage_end_metrics(st.reason, state, st.data, self.plan, self.world))
        stage_metrics["perf/optimize_s"] = optimize_s
        stage_metrics["perf/eval_s"] = self.evaluator.finish_stage(state)
        stage_metrics["perf/checkpoint_s"] = self.run.checkpoint_s - self.ckpt_mark
        stage_metrics.update(getattr(self.source, "stage_end_metrics", dict)())  # async: idle fractions (ahead.py)
        self.log("stage", stage_metrics, update_in_stage=state.update_in_stage)
        if self.world.is_main:
            self.progress.stage_summary(state.stage, stage_metrics)
        state.stage += 1
        state.update_in_stage = 0
        state.stage_first_log_ratio = None
        self.ckpt_mark = self.run.checkpoint_s  # the stage-end checkpoint counts in the next stage
        self.current_stage = None

    def more(self) -> bool:
        # (at the last stage too, when a stop abandoned its evaluation: the resume runs it, then exports)
        return self.state.update < self.plan.total_updates or self.state.eval_pending

    def finish(self):
        """Check the run changed the policy; the tokenizer to export with (None: ``train.save_final_model``
        is off)."""
        check_some_steps_applied(self.state, "updates", "Check the rewards (reward/num_invalid, "
                                 "stages/*/rollouts.jsonl), lower optim.lr, or turn off train.autocast")
        return self.parts.tokenizer if self.cfg.train.save_final_model else None

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
        state, world, step, device = self.state, self.world, self.settings, self.device
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
        step = self.settings
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


@dataclass(eq=False)
class _Stage:
    """The stage being optimised: its data and generation metrics, its longest length (adaptive stages may
    end sooner), its progress bar, and the clocks of its optimisation."""

    data: StageData
    metrics: dict
    max_length: int
    bar: Any
    t_opt: float
    checkpoint_s_at_start: float
    reason: str | None = None


def _stage_end_metrics(reason: str, state: RLState, data: StageData, plan: Plan, world) -> dict:
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
