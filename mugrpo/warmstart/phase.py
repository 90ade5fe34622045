"""The supervised warm start as a training phase: demonstrations in, an HF model folder out.

:func:`sft` runs (or resumes) a warm-start run: ``mugrpo sft`` (kind ``sft``), or the warm start of a
``mugrpo train`` run with ``warmstart.data`` (kind ``warmstart``, in ``RUN_DIR/warmstart/``; run by
:mod:`mugrpo.pipeline`, above both this phase and RL). :class:`WarmStart` is the phase itself: built
from the config, it owns the model side, the examples (:class:`ExampleSet`) and the run state; its
:meth:`WarmStart.step` is one optimizer step, and the run's lifecycle takes it through its order
(:class:`~mugrpo.kit.lifecycle.PhaseRun`: claim, resume, the loop around the step with its checkpoints
and stops, the export).

What is shared with RL, not written twice (the trainer kit, :mod:`mugrpo.kit`): the model side
(:func:`~mugrpo.kit.model_parts.build_model`: tokenizer checks, LoRA, FSDP2, AdamW and its schedule),
the data layout (the examples, an :class:`ExampleSet` of groups of one, cut by
:func:`~mugrpo.kit.batching.micro_batches` under ``schedule.micro_batch_tokens``), the forward
(:func:`~mugrpo.kit.forward.response_logprobs`, at temperature 1.0, not the RL temperature), the
accumulate-and-step with its filler passes and non-finite skip (:mod:`mugrpo.kit.step`), the seeded
data order (:func:`~mugrpo.kit.order.step_examples`), the run's lifecycle (claim, lock, stop,
resume, the loop with its checkpoints, export: :mod:`mugrpo.kit.lifecycle`), and the logger. What is its own: the loss
(:mod:`mugrpo.warmstart.loss`).

A policy turn a demonstration marks ``train: false`` gets the environment's turn index (-1) in the
examples' turns, so ``MicroBatch.response_mask`` (``turns >= 0``) leaves it out of the loss, as it leaves
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
from mugrpo.kit.lifecycle import PhaseRun, RunLifecycle
from mugrpo.kit.model_parts import ModelParts, build_model
from mugrpo.kit.order import step_examples
from mugrpo.kit.step import accumulate, check_some_steps_applied, device_batches, step_optimizer
from mugrpo import stopping
from mugrpo.warmstart import guard
from mugrpo.warmstart.data import DemonstrationError
from mugrpo.warmstart.loss import num_steps, sft_loss
from mugrpo.warmstart.render import ENV_TURN, Example
from mugrpo.warmstart.source import Source, load_source, max_length_for

SFT_TEMPERATURE = 1.0
"""The warm start fits the model's own distribution: log-probs at temperature 1, whatever
``rollout.temperature`` RL samples with."""


@dataclass(frozen=True)
class ExampleSet:
    """The warm start's examples as the kit lays them out (:class:`mugrpo.kit.batching.Sequences`): one
    prompt per response (groups of one), the trained tokens those with ``turns >= 0`` (an untrained
    policy turn gets :data:`ENV_TURN`); no log-probs, rewards or advantages (the loss reads none)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    turns: list[list[int]]
    group_size: int = 1
    behavior_logprobs = None
    trainer_logprobs = None
    advantages = None

    @classmethod
    def of(cls, examples: list[Example]) -> "ExampleSet":
        return cls([e.prompt_ids for e in examples], [e.response_ids for e in examples],
                   [[t if m else ENV_TURN for t, m in zip(e.turns, e.response_mask)] for e in examples])

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def num_policy_tokens(self, s: int) -> int:
        """Trained tokens of example ``s``: what the step's normaliser counts."""
        return sum(1 for k in self.turns[s] if k >= 0)


def load(cfg: Config, rows: list | None = None) -> Source:
    """``warmstart.data``'s source (:func:`mugrpo.warmstart.source.load_source`: demonstrations, or a
    run's selected trajectories; ``rows``: those given from Python); the CLI exits 2 for one that
    cannot be used."""
    return load_source(cfg, rows)


@dataclass(eq=False)
class WarmStart:
    """One warm start's machinery and state: a :class:`~mugrpo.kit.lifecycle.Phase` (the lifecycle runs its
    loop), :meth:`step` one optimizer step. Its one unit is the whole warm start."""

    cfg: Config
    world: Any
    model: ModelParts
    data: ExampleSet
    total_steps: int
    run_dir: RunDir
    autocast: bool = False
    counts: dict = field(default_factory=dict)
    """The length rule's counts (:func:`mugrpo.warmstart.render.render_demonstrations`)."""
    state: RunState = field(default_factory=RunState)
    logger: Any = field(default_factory=NullLogger)
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    t_start: float = field(default_factory=time.perf_counter)
    _bar: Any = None

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
            if world.size == 1:  # ranks: checked after the build, all alike (the lifecycle's stop point)
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
        return cls(cfg, world, model, ExampleSet.of(examples), total, run_dir, autocast, counts)

    @property
    def checkpoint_every(self) -> int | None:
        return self.cfg.warmstart.checkpoint_every

    def checkpointed(self) -> tuple:
        return self.model.policy, self.model.optimizer, self.model.scheduler

    def kept_after_resume(self, record: dict) -> bool:
        """The records of the steps up to the checkpoint (and the data record, update 0)."""
        return record.get("update", 0) <= self.state.update

    def on_claim(self) -> None:
        pass

    def start(self, run: PhaseRun) -> None:
        """Open the logger (and log the data's counts in a new run), start the clock and the progress bar."""
        cfg, world = self.cfg, self.world
        self.logger = make_logger(cfg, self.run_dir.path) if world.is_main else NullLogger()
        self.t_start = time.perf_counter() - self.state.elapsed_s
        if self.state.update == 0:
            self.logger.log({"kind": "sft_data", **self.counts, "num_steps": self.total_steps})
        self.progress = Progress(enabled=cfg.train.progress and world.is_main)
        self._bar = self.progress.bar(self.total_steps, "warm start", unit="step", initial=self.state.update)

    def step(self) -> bool:
        """One optimizer step, logged (a line per step without bars) and guarded (a warm start mostly skipped
        or diverged stops: :mod:`mugrpo.warmstart.guard`); True at the last step."""
        cfg, state = self.cfg, self.state
        t_step = time.perf_counter()
        metrics = self.optimizer_step()
        state.update += 1
        if self.world.is_main and not self.progress.enabled:
            print(guard.step_line(state.update, self.total_steps, metrics, time.perf_counter() - t_step), flush=True)
        self.logger.log({"kind": "sft", "stage": 0, "update": state.update,
                         "time_s": time.perf_counter() - self.t_start, **metrics})
        self.progress.advance(self._bar, 1)
        guard.check_step(state.update, self.total_steps, metrics["sft/loss"], state.num_skipped_updates,
                         len(self.model.tokenizer), cfg.warmstart.lr)
        maybe_die("sft_step")
        return state.update >= self.total_steps

    def end_unit(self) -> None:
        """The warm start's end (checkpointed next: a resume after the export finds nothing left to do)."""
        self.progress.close(self._bar)
        check_some_steps_applied(self.state, "warm-start steps", "Lower warmstart.lr or set train.autocast=none")

    def more(self) -> bool:
        return self.state.update < self.total_steps

    def finish(self):
        """The tokenizer the final model is exported with."""
        return self.model.tokenizer

    def optimizer_step(self) -> dict:
        """One optimizer step on this step's examples (:func:`mugrpo.kit.order.step_examples`); its metrics."""
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
        with life.phase() as run:  # (a stop while the data rendered: nothing written yet for a new run)
            return run.run(WarmStart.build(cfg, world, rd, source))
