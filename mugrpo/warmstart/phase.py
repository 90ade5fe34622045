"""The supervised warm start as a training phase: demonstrations in, an HF model folder out.

:func:`sft` runs (or resumes) a warm-start run: ``mugrpo sft`` (kind ``sft``), or the warm start of a
``mugrpo train`` run with ``warmstart.data`` (kind ``warmstart``, in ``RUN_DIR/warmstart/``; run by
:mod:`mugrpo.pipeline`, above both this phase and RL). :class:`WarmStart` is the phase itself: built
from the config, it owns the model side, the examples and the run state, and its
:meth:`WarmStart.step` is one optimizer step.

What is shared with RL, not written twice (the trainer kit, :mod:`mugrpo.kit`): the model side
(:func:`~mugrpo.kit.model_parts.build_model`: tokenizer checks, LoRA, FSDP2, AdamW and its schedule),
the data layout (the examples become a :class:`~mugrpo.stages.data.StageData` of groups of one, cut by
:func:`~mugrpo.kit.batching.micro_batches` under ``schedule.micro_batch_tokens``), the forward
(:func:`~mugrpo.kit.forward.response_logprobs`, at temperature 1.0, not the RL temperature), the
accumulate-and-step with its filler passes and non-finite skip (:mod:`mugrpo.kit.step`), the seeded
data order (:func:`~mugrpo.kit.order.step_examples`), the run's lifecycle (claim, lock, stop,
resume, checkpoints, export: :mod:`mugrpo.kit.lifecycle`), and the logger. What is its own: the loss
(:mod:`mugrpo.warmstart.loss`).

A policy turn a demonstration marks ``train: false`` gets the environment's turn index (-1) in the
stage data, so ``MicroBatch.response_mask`` (``turns >= 0``) leaves it out of the loss, as it leaves
environment tokens out.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mugrpo.config import Config
from mugrpo.config.plan import make_plan
from mugrpo.faults import maybe_die
from mugrpo.hardware import detect, resolve
from mugrpo.models.loading import load_tokenizer, resolve_model_path
from mugrpo.observability.loggers import NullLogger, make_logger
from mugrpo.observability.progress import Progress
from mugrpo.run_dir import RunDir
from mugrpo.kit import distributed as dist
from mugrpo.kit.checkpoint import RunState
from mugrpo.kit.forward import response_logprobs
from mugrpo.kit.lifecycle import RunLifecycle
from mugrpo.kit.model_parts import ModelParts, build_model
from mugrpo.kit.order import step_examples
from mugrpo.kit.step import accumulate, check_some_steps_applied, device_batches, step_optimizer
from mugrpo.stages.data import StageData
from mugrpo import stopping
from mugrpo.stopping import Interrupted
from mugrpo.warmstart import guard
from mugrpo.warmstart.data import DemonstrationError
from mugrpo.warmstart.loss import num_steps, sft_loss
from mugrpo.warmstart.render import ENV_TURN, Example
from mugrpo.warmstart.source import Source, load_source, max_length_for

SFT_TEMPERATURE = 1.0
"""The warm start fits the model's own distribution: log-probs at temperature 1, whatever
``rollout.temperature`` RL samples with."""


def as_stage_data(examples: list[Example]) -> StageData:
    """``examples`` as stage data of groups of one: the trained tokens are ``turns >= 0`` (an
    untrained policy turn gets :data:`ENV_TURN`); log-probs, rewards and advantages are unused zeros."""
    n = len(examples)
    turns = [[t if m else ENV_TURN for t, m in zip(e.turns, e.response_mask)] for e in examples]
    return StageData([e.prompt_ids for e in examples], [e.response_ids for e in examples],
                     [[0.0] * len(e.response_ids) for e in examples], torch.zeros(n), torch.zeros(n),
                     torch.ones(n, dtype=torch.bool), list(range(n)), 1, turns=turns)


def load(cfg: Config, rows: list | None = None) -> Source:
    """``warmstart.data``'s source (:func:`mugrpo.warmstart.source.load_source`: demonstrations, or a
    run's selected trajectories; ``rows``: those given from Python); the CLI exits 2 for one that
    cannot be used."""
    return load_source(cfg, rows)


@dataclass(eq=False)
class WarmStart:
    """One warm start's machinery and state; :meth:`run` is its loop, :meth:`step` one optimizer step."""

    cfg: Config
    world: Any
    model: ModelParts
    data: StageData
    total_steps: int
    run_dir: RunDir
    autocast: bool = False
    counts: dict = field(default_factory=dict)
    """The length rule's counts (:func:`mugrpo.warmstart.render.render_demonstrations`)."""
    life: RunLifecycle | None = None
    """The run's lifecycle: resume, checkpoints, export (None: single steps only)."""
    state: RunState = field(default_factory=RunState)
    logger: Any = field(default_factory=NullLogger)
    t_start: float = field(default_factory=time.perf_counter)

    @classmethod
    def build(cls, cfg: Config, world, run_dir: RunDir, source: Source) -> "WarmStart":
        """Make ``source``'s examples with the model's tokenizer (printing the length rule's counts), then
        build the model side with the warm start's learning rate and a schedule over its steps. A stop
        requested while rendering raises Interrupted there (one process; ranks check after the build)."""
        ws = cfg.warmstart
        model_path = dist.broadcast_object(resolve_model_path(cfg.model.name, cfg.model.cache_dir)
                                           if world.is_main else None)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        max_length = max_length_for(cfg, model_path)
        # progress while rendering (100k rows took minutes in silence), and a stop honoured there
        ticker = Progress(cfg.train.progress and world.is_main, lines=world.is_main).ticker(
            len(source), "warm start: rendering", unit="row")

        def on_row() -> None:
            ticker.advance(1)
            if world.size == 1:  # ranks: checked after the build, all alike (RunLifecycle.stop_point)
                stopping.check()

        examples, counts = source.examples(tokenizer, max_length, on_row)
        ticker.close()
        if world.is_main:
            if source.trajectories is not None:
                print(f"[mugrpo] warm start (rejection sampling): {source.describe()}")
            print(f"[mugrpo] warm start: {counts['num_demonstrations']} examples, {counts['num_truncated']} "
                  f"cut to max_length={max_length} tokens, {counts['num_dropped']} dropped (no trained token left), "
                  f"{counts['num_loss_tokens']} trained tokens"
                  + (f"; {counts['num_cut_texts']} texts cut by characters before tokenizing (docs/WARMSTART.md)"
                     if counts.get("num_cut_texts") else ""))
        if not examples:
            raise DemonstrationError(f"every demonstration in {ws.data} was dropped: none has a trained token within "
                                     f"warmstart.max_length={max_length} tokens; raise warmstart.max_length")
        total = num_steps(len(examples), ws.batch_size, ws.epochs, ws.steps)
        optim = dataclasses.replace(cfg.optim, lr=ws.lr, warmup_updates=0)
        plan = dataclasses.replace(make_plan(cfg, world.size), total_updates=total)
        model = build_model(dataclasses.replace(cfg, optim=optim), plan, world, with_ref=False, model_path=model_path)
        autocast = resolve(cfg.train.autocast, cfg.rollout.dtype, "hf", detect()).autocast == "bf16"
        return cls(cfg, world, model, as_stage_data(examples), total, run_dir, autocast, counts)

    def step(self) -> dict:
        """One optimizer step on this step's examples (:func:`mugrpo.kit.order.step_examples`)."""
        cfg, m = self.cfg, self.model
        seqs = step_examples(self.data.num_groups, cfg.warmstart.batch_size, self.state.update, cfg.train.seed)
        mean_nll, num_tokens = self.gradients(seqs)
        out = {"sft/loss": mean_nll, "sft/num_tokens": num_tokens, "sft/num_examples": len(seqs)}
        out.update(step_optimizer(m.policy, m.optimizer, m.scheduler, self.state, cfg.optim.max_grad_norm,
                                  cfg.checkpoint.max_bad_updates, mean_nll, what="warm-start step"))
        return out

    def gradients(self, seqs: list[int]) -> tuple[float, float]:
        """Accumulate the gradient of the step of examples ``seqs`` (this rank's share of them, micro-batched
        under ``schedule.micro_batch_tokens``): the NLL divided by the whole step's trained tokens.

        Every rank holds every example, so the normaliser is counted from ``seqs`` alone: the global
        token count with no collective. Returns (the step's mean NLL, the trained tokens the ranks'
        forwards covered), both summed over ranks in one all-reduce: the count equals the normaliser
        when the ranks' shares cover the step once (tests/warmstart/test_phase_distributed.py reads it)."""
        data, world, m = self.data, self.world, self.model
        num_tokens = float(sum(data.num_policy_tokens(s) for s in seqs))
        layout = {"shared": False, "budget": self.cfg.schedule.micro_batch_tokens,
                  "max_seqs": self.cfg.schedule.micro_batch_size, "pad_id": m.tokenizer.pad_token_id}
        mine = seqs[world.rank::world.size]
        batches, real = device_batches(data, mine, seqs[:1], layout, m.device)

        def micro_loss(mb):
            logprobs, _ = response_logprobs(m.policy, mb, SFT_TEMPERATURE, self.autocast, False, False)
            loss, summed = sft_loss(logprobs, mb.response_mask, max(num_tokens, 1.0))
            return loss, (summed.float().cpu(), mb.response_mask.sum().float().cpu())

        nll, covered = torch.zeros(()), torch.zeros(())
        for summed, count in accumulate(m.policy, batches, real, world, micro_loss):
            nll, covered = nll + summed, covered + count
        nll, covered = dist.sum_over_ranks(torch.stack([nll, covered])).tolist()
        return nll / max(num_tokens, 1.0), covered

    def resume(self) -> None:
        """Load the newest checkpoint (if any) and drop metric records from beyond it (all of them without one)."""
        m = self.model
        self.state = self.life.resume_state(m.policy, m.optimizer, m.scheduler, self.cfg.eval)

    def save(self) -> None:
        m = self.model
        self.life.save(m.policy, m.optimizer, m.scheduler, self.state, self.t_start)

    def run(self) -> Path:
        """Steps until ``total_steps`` (checkpointing every ``warmstart.checkpoint_every`` and on a stop
        request, which then raises Interrupted: :meth:`RunLifecycle.after_step`), then export the final
        model; returns its folder."""
        cfg, state, world = self.cfg, self.state, self.world
        self.logger = make_logger(cfg, self.run_dir.path) if world.is_main else NullLogger()
        self.t_start = time.perf_counter() - state.elapsed_s
        if state.update == 0:
            self.logger.log({"kind": "sft_data", **self.counts, "num_steps": self.total_steps})
        progress = Progress(enabled=cfg.train.progress and world.is_main)
        bar = progress.bar(self.total_steps, "warm start", unit="step", initial=state.update)
        while state.update < self.total_steps:
            t_step = time.perf_counter()
            metrics = self.step()
            state.update += 1
            state.update_in_stage = state.update
            # a line per step without bars; stop a warm start mostly skipped or diverged (warmstart/guard.py)
            if world.is_main and not progress.enabled:
                print(guard.step_line(state.update, self.total_steps, metrics, time.perf_counter() - t_step),
                      flush=True)
            self.logger.log({"kind": "sft", "stage": 0, "update": state.update,
                             "time_s": time.perf_counter() - self.t_start, **metrics})
            progress.advance(bar, 1)
            guard.check_step(state.update, self.total_steps, metrics["sft/loss"], state.num_skipped_updates,
                             len(self.model.tokenizer), cfg.warmstart.lr)
            maybe_die("sft_step")
            stop, due = self.life.after_step(state.update, cfg.warmstart.checkpoint_every)
            if state.update < self.total_steps and (stop or due):
                self.save()
                if stop:
                    raise Interrupted(self.run_dir.path)
        progress.close(bar)
        check_some_steps_applied(state, "warm-start steps", "Lower warmstart.lr or set train.autocast=none")
        self.save()  # the end: a resume after the export finds nothing left to do
        return self.life.export(self.model.policy, self.model.tokenizer)

    def close(self) -> None:
        self.logger.close()


def sft(cfg: Config, run_dir: Path, resume: bool = False, rows: list | None = None, kind: str = "sft") -> Path:
    """Run (or resume) a warm-start run in ``run_dir``; returns its final model folder, an HF folder that
    ``model.name`` of an RL run can name. ``cfg`` of a resume comes from
    :func:`mugrpo.kit.lifecycle.resume_config` (or, inside an RL run, is the RL run's own); ``rows``: the
    demonstrations a ``python:`` label in ``warmstart.data`` stands for (``mugrpo.sft``); ``kind``:
    ``sft``, or ``warmstart`` for the warm start inside a train run (its resume command is the run's)."""
    world = dist.init(cfg.parallel.timeout_s)
    rd = RunDir(dist.broadcast_object(run_dir))  # rank 0's: a default name holds the time, which ranks may not share
    with RunLifecycle(rd, cfg, kind, resume, world) as life:  # a resume of another kind stops here, nothing written
        source = load(cfg, rows)  # bad data stops here, before any model loads or anything is written
        life.stop_point()  # a stop while the data rendered: nothing written yet for a new run
        if resume:
            life.claim()
        else:
            life.check_free()
        phase = WarmStart.build(cfg, world, rd, source)
        phase.life = life
        maybe_die("model_loaded")
        life.close_at_exit(phase.close)
        if resume:
            phase.resume()
        else:
            life.stop_point()
            life.claim()
        life.stop_point()  # a stop while the examples rendered or the model loaded
        return phase.run()
