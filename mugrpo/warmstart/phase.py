"""The supervised warm start as a training phase: demonstrations in, an HF model folder out.

:func:`sft` runs (or resumes) a warm-start-only run (``mugrpo sft``); :func:`warm_start_model` runs
the warm start of an RL run with ``warmstart.data`` inside its run directory (``RUN_DIR/warmstart/``,
a sub-run with its own config, metrics, checkpoints and final model, skipped once that final model
exists) and returns the folder RL starts from. :class:`WarmStart` is the phase itself: built from
the config, it owns the model side, the examples and the run state, and its :meth:`WarmStart.step`
is one optimizer step.

What is shared with RL, not written twice: the model side (:func:`mugrpo.training.model_parts.build_model`:
tokenizer checks, LoRA, FSDP2, AdamW and its schedule), the data layout (the examples become a
:class:`~mugrpo.training.data.StageData` of groups of one, cut by
:func:`~mugrpo.training.batching.micro_batches` under ``schedule.micro_batch_tokens``), the forward
(:func:`~mugrpo.training.forward.response_logprobs`, at temperature 1.0, not the RL temperature), the
clip / non-finite skip (:func:`~mugrpo.training.model_parts.step_optimizer`), checkpoints, resume,
the lock and the export (:mod:`mugrpo.training.checkpoint`), and the logger. What is its own: the
loss and the data order (:mod:`mugrpo.warmstart.loss`).

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

from mugrpo.config import Config, ConfigError, from_dict, read_run_config, to_dict
from mugrpo.config.plan import make_plan
from mugrpo.faults import maybe_die
from mugrpo.hardware import detect, resolve
from mugrpo.models.loading import load_tokenizer, resolve_model_path
from mugrpo.observability.loggers import NullLogger, make_logger
from mugrpo.observability.progress import Progress
from mugrpo.run_dir import RunDir
from mugrpo.training import checkpoint as ckpt
from mugrpo.training import distributed as dist
from mugrpo.training.batching import micro_batches
from mugrpo.training.checkpoint import RunState
from mugrpo.training.data import StageData
from mugrpo.training.forward import response_logprobs
from mugrpo.training.lifecycle import RunClaim
from mugrpo.training.model_parts import ModelParts, TrainingError, build_model, step_optimizer
from mugrpo.training.update import with_fillers
from mugrpo.warmstart import guard
from mugrpo.warmstart.data import DemonstrationError
from mugrpo.warmstart.loss import num_steps, sft_loss, step_examples
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
    state: RunState = field(default_factory=RunState)
    logger: Any = field(default_factory=NullLogger)
    t_start: float = field(default_factory=time.perf_counter)

    @classmethod
    def build(cls, cfg: Config, world, run_dir: RunDir, source: Source, stopper=None) -> "WarmStart":
        """Make ``source``'s examples with the model's tokenizer (printing the length rule's counts), then
        build the model side with the warm start's learning rate and a schedule over its steps.
        ``stopper``: an RL run's, checked while rendering (a stop raises Interrupted there)."""
        ws = cfg.warmstart
        model_path = dist.broadcast_object(resolve_model_path(cfg.model.name, cfg.model.cache_dir)
                                           if world.is_main else None)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        max_length = max_length_for(cfg, model_path)
        # issue 34: progress while rendering (100k rows took minutes in silence), and a stop honoured there
        ticker = Progress(cfg.train.progress and world.is_main, lines=world.is_main).ticker(
            len(source), "warm start: rendering", unit="row")

        def on_row() -> None:
            ticker.advance(1)
            if stopper is not None and stopper.requested and world.size == 1:  # ranks: checked after the build
                raise ckpt.Interrupted(run_dir.path)

        examples, counts = source.examples(tokenizer, max_length, on_row)
        ticker.close()
        if world.is_main:
            if source.trajectories is not None:
                print(f"[mugrpo] warm start (rejection sampling): {source.describe()}")
            print(f"[mugrpo] warm start: {counts['num_demonstrations']} examples, {counts['num_truncated']} "
                  f"cut to max_length={max_length} tokens, {counts['num_dropped']} dropped (no trained token left), "
                  f"{counts['num_loss_tokens']} trained tokens")
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
        """One optimizer step on this step's examples (:func:`mugrpo.warmstart.loss.step_examples`)."""
        cfg, m = self.cfg, self.model
        seqs = step_examples(self.data.num_groups, cfg.warmstart.batch_size, self.state.update, cfg.train.seed)
        mean_nll, num_tokens = self.gradients(seqs)
        out = {"sft/loss": mean_nll, "sft/num_tokens": num_tokens, "sft/num_examples": len(seqs)}
        out.update(step_optimizer(m.policy, m.optimizer, m.scheduler, self.state, cfg.optim.max_grad_norm,
                                  cfg.checkpoint.max_bad_updates, mean_nll))
        return out

    def gradients(self, seqs: list[int]) -> tuple[float, float]:
        """Accumulate the gradient of the step of examples ``seqs`` (this rank's share of them, micro-batched
        under ``schedule.micro_batch_tokens``): the NLL divided by the whole step's trained tokens.

        Every rank holds every example, so the normaliser is counted from ``seqs`` alone: the global
        token count with no collective. Returns (the step's mean NLL, the trained tokens the ranks'
        forwards covered), both summed over ranks in one all-reduce: the count equals the normaliser
        when the ranks' shares cover the step once (tests/test_sft_distributed.py reads it)."""
        data, world, m = self.data, self.world, self.model
        num_tokens = float(sum(data.num_policy_tokens(s) for s in seqs))
        layout = {"shared": False, "budget": self.cfg.schedule.micro_batch_tokens,
                  "max_seqs": self.cfg.schedule.micro_batch_size, "pad_id": m.tokenizer.pad_token_id}
        mine = seqs[world.rank::world.size]
        batches, real = with_fillers([b.to(m.device) for b in micro_batches(data, mine, **layout)],
                                     lambda: [b.to(m.device) for b in micro_batches(data, seqs[:1], **layout)])
        nll, covered = torch.zeros(()), torch.zeros(())
        for i, mb in enumerate(batches):
            with dist.no_sync_unless_last(m.policy, i == len(batches) - 1):
                logprobs, _ = response_logprobs(m.policy, mb, SFT_TEMPERATURE, self.autocast, False, False)
                loss, summed = sft_loss(logprobs, mb.response_mask, max(num_tokens, 1.0))
                if i >= real:  # a filler pass: the collectives run, nothing is added
                    loss = loss * 0.0
                (loss * world.size).backward()  # DDP/FSDP average over ranks; the loss is a share of the sum
            if i < real:
                nll = nll + summed.float().cpu()
                covered = covered + mb.response_mask.sum().float().cpu()
        if not batches:  # a rank without examples: a zero gradient, so every rank steps alike
            for p in m.policy.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        nll, covered = dist.sum_over_ranks(torch.stack([nll, covered])).tolist()
        return nll / max(num_tokens, 1.0), covered

    def resume(self) -> None:
        """Load the newest checkpoint (if any) and drop metric records from beyond it (all of them without one)."""
        if self.world.is_main:
            ckpt.remove_stale_temporaries(self.run_dir.path)
        m = self.model
        self.state = ckpt.load_latest(self.run_dir.path, m.policy, m.optimizer, m.scheduler, self.world) or RunState()
        if self.world.is_main and self.state.update == 0:  # no checkpoint: the warm start and its log start over
            self.run_dir.metrics.unlink(missing_ok=True)
        elif self.world.is_main:
            ckpt.truncate_metrics(self.run_dir.metrics, self.state, self.cfg.eval)

    def save(self) -> None:
        m = self.model
        ckpt.save(self.run_dir.path, m.policy, m.optimizer, m.scheduler, self.state, self.cfg, self.world,
                  elapsed_s=time.perf_counter() - self.t_start)

    def run(self, stopper) -> Path:
        """Steps until ``total_steps`` (checkpointing every ``warmstart.checkpoint_every`` and on a stop
        request, which then raises Interrupted), then export the final model; returns its folder."""
        cfg, state, world = self.cfg, self.state, self.world
        self.logger = make_logger(cfg, self.run_dir.path) if world.is_main else NullLogger()
        self.t_start = time.perf_counter() - state.elapsed_s
        if state.update == 0:
            self.logger.log({"kind": "sft_data", **self.counts, "num_steps": self.total_steps})
        progress = Progress(enabled=cfg.train.progress and world.is_main)
        bar = progress.bar(self.total_steps, "warm start", unit="step", initial=state.update)
        every = cfg.warmstart.checkpoint_every
        while state.update < self.total_steps:
            t_step = time.perf_counter()
            metrics = self.step()
            state.update += 1
            state.update_in_stage = state.update
            # issue 34: a line per step without bars; stop a warm start mostly skipped or diverged (warmstart/guard.py)
            if world.is_main and not progress.enabled:
                print(guard.step_line(state.update, self.total_steps, metrics, time.perf_counter() - t_step),
                      flush=True)
            self.logger.log({"kind": "sft", "stage": 0, "update": state.update,
                             "time_s": time.perf_counter() - self.t_start, **metrics})
            progress.advance(bar, 1)
            guard.check_step(state.update, self.total_steps, metrics["sft/loss"], state.num_skipped_updates,
                             len(self.model.tokenizer), cfg.warmstart.lr)
            maybe_die("sft_step")
            # A signal may reach the ranks a step apart: all stop after the step one of them saw it in
            # (the checkpoint is a collective; a rank saving alone would wait in it until parallel.timeout_s).
            stop = dist.max_over_ranks(int(stopper.requested)) > 0
            if state.update < self.total_steps and (stop or (every and state.update % every == 0)):
                self.save()
                if stop:
                    raise ckpt.Interrupted(self.run_dir.path, "sft")
        progress.close(bar)
        if state.update and state.num_skipped_updates >= state.update:
            raise TrainingError(f"all {state.update} warm-start steps were skipped for a non-finite loss or gradient; "
                                "no model was written. Lower warmstart.lr or set train.autocast=none")
        self.save()  # the end: a resume after the export finds nothing left to do
        ckpt.export_hf(self.model.policy, self.model.tokenizer, self.run_dir.final_model, world, "sft")
        return self.run_dir.final_model

    def close(self) -> None:
        self.logger.close()


def sft(cfg: Config, run_dir: Path, resume: bool = False, rows: list | None = None, stopper=None) -> Path:
    """Run (or resume) a warm-start-only run in ``run_dir``; returns its final model folder, an HF
    folder that ``model.name`` of an RL run can name. ``cfg`` of a resume comes from
    :func:`mugrpo.training.checkpoint.resume_config` (or, inside an RL run, is the RL run's own);
    ``rows``: the demonstrations a ``python:`` label in ``warmstart.data`` stands for (``mugrpo.sft``);
    ``stopper``: the RL run's own (its warm start), else the warm start installs one when its steps
    start."""
    world = dist.init(cfg.parallel.timeout_s)
    rd = RunDir(dist.broadcast_object(run_dir))  # rank 0's: a default name holds the time, which ranks may not share
    source = load(cfg, rows)  # bad data stops here, before any model loads or anything is written
    with RunClaim(rd, cfg, resume, world) as run:
        if resume:
            run.claim()
        else:
            ckpt.check_run_dir_free(rd.path)
        phase = WarmStart.build(cfg, world, rd, source, stopper)
        run.close_at_exit(phase.close)
        if resume:
            phase.resume()
        else:
            run.claim()
        return phase.run(stopper or run.stop_on_signals(name_resume_command=False))


def warm_start_path(cfg: Config, run_dir: RunDir) -> str | None:
    """The folder an RL run with ``warmstart.data`` loads its policy, reference and engine from (the
    warm start's final model), or None without a warm start. A path only: nothing runs here."""
    return str(RunDir(run_dir.warmstart).final_model) if cfg.warmstart.data is not None else None


def warm_start_model(cfg: Config, run_dir: RunDir, stopper=None) -> str:
    """Run, resume or skip the warm start of the RL run in ``run_dir``; returns the folder RL starts from.

    The sub-run ``RUN_DIR/warmstart/`` trains with the RL run's config. Skipped when its final model
    exists; resumed when it was started. ``stopper``: the RL run's, so a stop anywhere in the warm start
    is the RL run's stop (the caller checks it after the warm start). Refused (ConfigError naming the
    key) when the sub-run found there was trained from another ``model.name``, or with other settings."""
    sub = RunDir(run_dir.warmstart)
    if sub.config.is_file():
        _check_same_warm_start(cfg, sub)
    if (sub.final_model / "config.json").is_file():  # the export is atomic: a complete folder
        print(f"[mugrpo] warm start done earlier: RL starts from {sub.final_model}")
        return str(sub.final_model)
    try:
        final = sft(cfg, sub.path, resume=sub.config.is_file(), stopper=stopper)
    except ckpt.Interrupted as exc:
        raise ckpt.Interrupted(run_dir.path) from exc
    print(f"[mugrpo] warm start done: RL starts from {final}")
    return str(final)


def _check_same_warm_start(cfg: Config, sub: RunDir) -> None:
    saved = read_run_config(sub.path, f"the warm start in {sub.path}")
    base = saved.get("model", {}).get("name")
    if base != cfg.model.name:
        raise ConfigError(f"model.name={cfg.model.name!r}, but the warm start in {sub.path} was trained from "
                          f"model.name={base!r}: the RL run must start from the model its warm start trained. Set "
                          f"model.name={base!r}, or delete {sub.path} to warm-start {cfg.model.name!r} afresh")
    ckpt.check_resume_compatible(to_dict(from_dict(saved)), to_dict(cfg), f"the warm start's config ({sub.config})")
