"""Evaluation inside the training loop: when it is due, the weight push, the record it logs.

:class:`TrainingEvaluator` is a component of a run (built by :class:`mugrpo.training.trainer.Trainer`
from the parts it needs, not from the trainer): the loop calls :meth:`~TrainingEvaluator.maybe_run`
after every update and :meth:`~TrainingEvaluator.finish_stage` at each stage end. Generating and
scoring are :mod:`mugrpo.evaluation.evaluate`'s (the same code as ``mugrpo eval``); under several
ranks each evaluates its share of the items and rank 0 logs the combined result.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional

import torch

from mugrpo import seeds
from mugrpo.evaluation.evaluate import (EnvEval, EvalSettings, Generations, generate_and_score, render_prompts,
                                        stop_if_nothing_started, summarize_generations)
from mugrpo.evaluation.schedule import due_in_loop
from mugrpo.faults import maybe_die
from mugrpo.kit import distributed as dist
from mugrpo.rollout.engines import weights_loaded
from mugrpo.stopping import Interrupted
from mugrpo.stages.samplers import RolloutParts


class TrainingEvaluator:
    """Evaluation inside the training loop (config ``eval.*``); the loop calls two methods.

    - :meth:`maybe_run` before the first update and after every update: evaluates the initial
      policy (``eval.at_start``) and every ``eval.every_updates`` updates, except at a stage's
      last update (``stage_ends``: the loop knows, an adaptive stage's length is decided as it
      goes), which is left to :meth:`finish_stage` (so its progress bar never nests).
    - :meth:`finish_stage` at each stage end: evaluates when due (``eval.every_stages``, the last
      stage, or an ``every_updates`` multiple) and returns the seconds spent evaluating during
      the stage, for ``perf/eval_s``. :attr:`in_loop_s` is the part spent inside the stage's
      optimisation loop, which the loop leaves out of ``perf/optimize_s``.

    Under several ranks, each evaluates its share of the items with its own engine and rank 0
    logs the combined result (every rank must call, as for the weight push).

    A stop request (:attr:`stopper`, a :class:`~mugrpo.kit.checkpoint.GracefulStop` the loop
    sets) ends an evaluation within one decode step, as it ends a stage's generation: an in-loop
    one is abandoned without a record (the loop then checkpoints the update and stops; the resumed
    run evaluates that update again at its start, :func:`~mugrpo.evaluation.schedule.due_in_loop`); so is a stage-end one, the
    stage then logged and checkpointed as usual with ``RunState.eval_pending`` set, and the resumed
    run evaluates that update at its start.
    """

    stopper = None

    def __init__(self, cfg, plan, world, parts: RolloutParts, policy, logger, progress, clock: Callable[[], float]):
        """``parts``: the run's engine, task, tokenizer and environment factory; ``policy``: whose
        weights are pushed to the engine before each evaluation; ``clock()``: the run's seconds so
        far (a record's ``time_s``)."""
        task, e = parts.task, cfg.eval
        self.cfg, self.plan, self.task, self.world = cfg, plan, task, world
        self.tokenizer, self.engine, self.policy = parts.tokenizer, parts.engine, policy
        self.logger, self.progress, self.clock = logger, progress, clock
        self.settings = EvalSettings(greedy=e.greedy, n=e.num_samples,
                                     ks=tuple(sorted({1, e.num_samples})) if e.num_samples else (),
                                     temperature=e.temperature, max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
                                     seed=seeds.eval_sampling(cfg.train.seed))
        items = task.eval_items[: e.num_items]
        self.enabled = bool(e.num_items)
        if self.enabled and not items:
            if world.is_main:
                print(f"[mugrpo] warning: task {task.name!r} has no held-out items (task.eval_size); "
                      "evaluation during training is off", file=sys.stderr)
            self.enabled = False
        self.env = EnvEval.build(parts.env_factory, cfg, cfg.task, self.settings.max_new_tokens)
        if self.env is None:
            self.prompts, self.items = render_prompts(self.tokenizer, items[world.rank::world.size], cfg.task)
        else:  # the environment renders its own prompts (with its tools)
            self.prompts, self.items = [], items[world.rank::world.size]
        self._stage_s = 0.0
        self.in_loop_s = 0.0
        """Seconds of this stage's evaluations run from inside its optimisation loop."""
        self._last_update: Optional[int] = None

    def maybe_run(self, state, stage_ends: bool = False) -> None:
        """``stage_ends``: this update ends its stage (mu reached, the budget, or an adaptive guard)."""
        if not self.enabled or stage_ends:
            return
        if state.eval_pending:  # a resumed run: the stage-end evaluation a stop abandoned
            if self._run(state) is None:  # abandoned again: stop before anything else, it stays pending
                self.stopper.check()
            state.eval_pending = False
            return
        if due_in_loop(self.cfg.eval, state.update):
            seconds = self._run(state)  # abandoned by a stop: the resume evaluates this update again
            if seconds is not None and state.update_in_stage > 0:
                self.in_loop_s += seconds

    def finish_stage(self, state) -> float:
        """Run the stage-end evaluation if due; return (and reset) the stage's evaluation seconds."""
        e = self.cfg.eval
        if self.enabled:
            last = state.update >= self.plan.total_updates  # by updates: adaptive stages vary in number
            stage_due = e.every_stages and ((state.stage + 1) % e.every_stages == 0 or last)
            update_due = e.every_updates and state.update % e.every_updates == 0
            if (stage_due or update_due) and self._run(state) is None:
                state.eval_pending = True  # the stage is still logged and checkpointed; the resume evaluates
        seconds, self._stage_s, self.in_loop_s = self._stage_s, 0.0, 0.0
        return seconds

    def _run(self, state) -> Optional[float]:
        """Evaluate now and log the record; returns the seconds it took (0 if done at this update), or
        None when a stop abandoned it (no record)."""
        if self._last_update == state.update:
            return 0.0
        t0 = time.perf_counter()
        n_seq = len(self.items) * (int(self.settings.greedy) + self.settings.n)
        with weights_loaded(self.engine, dist.full_state_items(self.policy)):  # a collective under FSDP2
            bar = self.progress.bar(n_seq, f"eval @ update {state.update}", unit="seq")
            try:
                gen = generate_and_score(self.engine, self.tokenizer, self.task, self.items, self.prompts,
                                         self.settings, progress=lambda n: self._advance(bar, n), env=self.env)
            except Interrupted:
                return None
            finally:
                self.progress.close(bar)
        self._last_update = state.update
        gen = _gather(gen, self.settings, self.world)
        stop_if_nothing_started(gen, self.env)  # every rank alike: on the combined counts
        seconds = time.perf_counter() - t0
        self._stage_s += seconds
        metrics = {f"eval/{k}": v for k, v in summarize_generations(gen, self.settings).items()}
        metrics["eval/num_items"] = int(metrics["eval/num_items"])
        metrics["perf/eval_s"] = seconds
        metrics["perf/eval_tok_s"] = sum(gen.lengths) / max(gen.generate_s, 1e-9)
        record = {"kind": "eval", "stage": state.stage, "update": state.update,
                  "update_in_stage": state.update_in_stage, "time_s": self.clock(),
                  **metrics}
        self.logger.log(record)
        if self.world.is_main:
            self.progress.eval_summary(state.update, metrics)
        return seconds

    def _advance(self, bar, n: int) -> None:
        """The evaluation's progress, and its stop check (``n`` = 0: a decode step's heartbeat)."""
        self.progress.advance(bar, n)
        maybe_die("eval")
        if self.stopper is not None:
            self.stopper.check()


def _gather(gen: Generations, settings: EvalSettings, world) -> Generations:
    """Concatenate every rank's per-item outcomes (identity in a single process).

    ``generate_s`` stays this rank's own, so tokens / generate_s is the ranks' combined rate.
    """
    if world.size == 1:
        return gen

    def cat(values, dtype=torch.float64):
        return dist.gather_cat(torch.tensor(values, dtype=dtype))

    # Every rank joins (a rank may have no items, hence no counts); {} when no rank evaluated through an env.
    out = Generations(generate_s=gen.generate_s, env_counts=dist.sum_named_over_ranks(gen.env_counts),
                      env_failures=gen.env_failures)
    out.env_rewards = {mode: cat(values).tolist() for mode, values in gen.env_rewards.items()}
    out.rewards = {mode: cat(values).tolist() for mode, values in gen.rewards.items()}
    if gen.greedy is not None:
        out.greedy = cat(gen.greedy).tolist()
    if gen.samples is not None:
        flat = cat([x for row in gen.samples for x in row])
        out.samples = flat.view(-1, settings.n).tolist()
    out.lengths = cat(gen.lengths, torch.long).tolist()
    out.truncated = cat(gen.truncated, torch.bool).tolist()
    return out
