"""Evaluating a policy: generate with a rollout engine, score with the task, summarise.

Two users: ``mugrpo eval`` (:mod:`mugrpo.evaluation.cli`) and the training loop, through
:class:`TrainingEvaluator`, which decides when an evaluation is due (``eval.*`` config), pushes
the current weights to the engine, logs a ``kind: eval`` record and keeps the seconds spent
for the stage record's ``perf/eval_s``.

Greedy responses use temperature 0; sampled ones use the eval temperature with top-p and top-k
off, and a fixed seed, so every evaluation of a run draws from the same random stream and the
differences between evaluations come from the weights. The engine's sampling never touches the
trainer's RNG (engines fork it), so evaluating does not change the training run.

With an environment (``task.env`` / ``task.tools``: :class:`EnvEval`), each response is a
multi-turn trajectory (:mod:`mugrpo.rollout.multiturn`, the prompts rendered by the environment
with its tools) and the task scores its final policy turn; the loop's counts are reported as
``env/*`` (e.g. ``eval/env/tool_calls``).

The metric math lives in :mod:`mugrpo.evaluation.metrics`; which items to evaluate in
:mod:`mugrpo.evaluation.sets`. Scoring is the task's own (:meth:`mugrpo.rollout.tasks.Task.score_all`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from mugrpo.training import distributed as dist
from mugrpo.training import seeds
from mugrpo.rollout.engines import SamplingConfig, weights_loaded
from mugrpo.rollout.multiturn import LoopLimits, finalize_counts, loop_counts, roll_out_items
from mugrpo.evaluation.metrics import summarize
from mugrpo.rollout.tasks import Item, Task, limit_prompts, prompt_ids


@dataclass(frozen=True)
class EvalSettings:
    greedy: bool = True
    """One greedy response per item."""
    n: int = 0
    """Sampled responses per item (0: none)."""
    ks: tuple[int, ...] = ()
    """pass@k is reported for each k (every k <= n)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    correct_at: float = 1.0
    """A sample with a score >= this counts as correct for pass@k."""


@dataclass
class Generations:
    """Raw per-item outcomes of one evaluation (before averaging)."""

    greedy: Optional[list[float]] = None
    """Greedy score per item."""
    samples: Optional[list[list[float]]] = None
    """Sampled scores per item, n each."""
    lengths: list[int] = field(default_factory=list)
    """Tokens of every response (greedy and sampled)."""
    truncated: list[bool] = field(default_factory=list)
    """Per response: stopped at max_new_tokens instead of EOS."""
    records: list[dict] = field(default_factory=list)
    """Per response (when asked for): item index, mode, text, score."""
    generate_s: float = 0.0
    env_counts: dict[str, float] = field(default_factory=dict)
    """With an environment: :func:`mugrpo.rollout.multiturn.loop_counts` summed over the modes."""


@dataclass(frozen=True)
class EnvEval:
    """Evaluate through an environment: its factory, the loop's limits, the task config (prompts)."""

    factory: Callable
    limits: LoopLimits
    task_cfg: object

    @classmethod
    def build(cls, factory, cfg, task_cfg, max_new_tokens: int) -> Optional["EnvEval"]:
        """None without a factory; else the run config's ``env`` limits with ``max_new_tokens`` as the
        trajectory's budget."""
        if factory is None:
            return None
        return cls(factory, LoopLimits.from_config(cfg.env, max_new_tokens), task_cfg)


def render_prompts(tokenizer, items: list[Item], task_cfg) -> tuple[list[list[int]], list[Item]]:
    """Prompt token ids and the items they belong to, with ``task.prompt_too_long`` applied to
    prompts over ``task.max_prompt_tokens``: ``error`` raises, ``skip`` drops the item (with a
    warning: the metrics are then over fewer items), ``truncate`` keeps the prompt's tail."""
    prompts = [prompt_ids(tokenizer, item.prompt, task_cfg) for item in items]
    prompts, kept = limit_prompts(prompts, task_cfg, "evaluation")
    if len(kept) < len(items):
        print(f"[mugrpo] warning: skipping {len(items) - len(kept)} of {len(items)} evaluation items whose prompt is "
              f"longer than task.max_prompt_tokens={task_cfg.max_prompt_tokens}", file=sys.stderr)
    return prompts, [items[i] for i in kept]


def generate_and_score(engine, tokenizer, task: Task, items: list[Item], prompts: list[list[int]],
                       settings: EvalSettings, progress: Optional[Callable[[int], None]] = None,
                       keep_text: bool = False, env: Optional[EnvEval] = None) -> Generations:
    """Greedy and/or n sampled responses per item, scored by ``task`` (``env``: multi-turn
    trajectories; ``prompts`` are then the environment's, rendered here)."""
    out = Generations()
    if not items:
        out.greedy = [] if settings.greedy else None
        out.samples = [] if settings.n else None
        return out
    runs = []
    if settings.greedy:
        runs.append(("greedy", SamplingConfig(n=1, temperature=0.0, max_new_tokens=settings.max_new_tokens,
                                              seed=settings.seed)))
    if settings.n:
        runs.append(("sample", SamplingConfig(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                                              top_k=0, max_new_tokens=settings.max_new_tokens, seed=settings.seed)))
    for mode, sampling in runs:
        t0 = time.perf_counter()
        texts, lengths, truncated = _responses(engine, tokenizer, items, prompts, sampling, progress, env, out)
        out.generate_s += time.perf_counter() - t0
        repeated = [item for item in items for _ in range(sampling.n)]
        scores, _ = task.score_eval(texts, repeated)
        per_item = scores.view(len(items), sampling.n).tolist()
        if mode == "greedy":
            out.greedy = [row[0] for row in per_item]
        else:
            out.samples = per_item
        out.lengths += lengths
        out.truncated += truncated
        if keep_text:
            out.records += [{"item": i // sampling.n, "mode": mode, "text": text, "score": float(score)}
                            for i, (text, score) in enumerate(zip(texts, scores.tolist()))]
    return out


def _responses(engine, tokenizer, items, prompts, sampling, progress, env: Optional[EnvEval], out: Generations
               ) -> tuple[list[str], list[int], list[bool]]:
    """(texts to score, response lengths, truncated flags), sampling.n per item, item-major."""
    if env is None:
        flat = [c for group in engine.generate(prompts, sampling, progress=progress) for c in group]
        return ([tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat],
                [len(c.token_ids) for c in flat], [c.finish_reason != "stop" for c in flat])
    _, _, trajs = roll_out_items(engine, env.factory, items, sampling, env.limits, group_size=sampling.n,
                                 reset_seed=sampling.seed, tokenizer=tokenizer, task_cfg=env.task_cfg,
                                 progress=progress)
    for key, value in loop_counts(trajs).items():
        out.env_counts[key] = out.env_counts.get(key, 0.0) + value
    return ([t.final_text for t in trajs], [sum(1 for k in t.turns if k >= 0) for t in trajs],
            [t.truncated for t in trajs])


def summarize_generations(gen: Generations, settings: EvalSettings) -> dict[str, float]:
    """``summarize`` plus response statistics: the metrics of one task, without a key prefix."""
    metrics = summarize(gen.greedy, gen.samples, [k for k in settings.ks if k <= settings.n], settings.correct_at)
    n_items = len(gen.greedy if gen.greedy is not None else gen.samples or [])
    metrics["num_items"] = n_items
    metrics["response_len_mean"] = sum(gen.lengths) / len(gen.lengths) if gen.lengths else float("nan")
    metrics["truncated_frac"] = sum(gen.truncated) / len(gen.truncated) if gen.truncated else float("nan")
    if gen.env_counts:  # multi-turn: how trajectories ended, turns, tool counts (env/*)
        metrics.update(finalize_counts(gen.env_counts))
    return metrics


# ---------------------------------------------------------------------------------------------
# During training.


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
    """

    def __init__(self, trainer):
        """``trainer``: the run's :class:`mugrpo.training.trainer.Trainer` (its config, plan, task,
        tokenizer, engine, policy, logger, world, progress and start time are read from it)."""
        cfg, task, world, e = trainer.cfg, trainer.task, trainer.world, trainer.cfg.eval
        self.trainer = trainer
        self.cfg, self.plan, self.task, self.world = cfg, trainer.plan, task, world
        self.tokenizer, self.engine, self.policy = trainer.tokenizer, trainer.engine, trainer.policy
        self.logger, self.progress = trainer.logger, trainer.progress
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
        self.env = EnvEval.build(getattr(trainer, "env_factory", None), cfg, cfg.task, self.settings.max_new_tokens)
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
        e = self.cfg.eval
        at_start = state.update == 0 and e.at_start
        periodic = state.update > 0 and e.every_updates and state.update % e.every_updates == 0
        if at_start or periodic:
            seconds = self._run(state)
            if state.update_in_stage > 0:
                self.in_loop_s += seconds

    def finish_stage(self, state) -> float:
        """Run the stage-end evaluation if due; return (and reset) the stage's evaluation seconds."""
        e = self.cfg.eval
        if self.enabled:
            last = state.update >= self.plan.total_updates  # by updates: adaptive stages vary in number
            stage_due = e.every_stages and ((state.stage + 1) % e.every_stages == 0 or last)
            update_due = e.every_updates and state.update % e.every_updates == 0
            if stage_due or update_due:
                self._run(state)
        seconds, self._stage_s, self.in_loop_s = self._stage_s, 0.0, 0.0
        return seconds

    def _run(self, state) -> float:
        """Evaluate now and log the record; returns the seconds it took (0 if done at this update)."""
        if self._last_update == state.update:
            return 0.0
        self._last_update = state.update
        t0 = time.perf_counter()
        n_seq = len(self.items) * (int(self.settings.greedy) + self.settings.n)
        with weights_loaded(self.engine, dist.full_state_items(self.policy)):  # a collective under FSDP2
            bar = self.progress.bar(n_seq, f"eval @ update {state.update}", unit="seq")
            gen = generate_and_score(self.engine, self.tokenizer, self.task, self.items, self.prompts, self.settings,
                                     progress=lambda n: self.progress.advance(bar, n), env=self.env)
            self.progress.close(bar)
        gen = _gather(gen, self.settings, self.world)
        seconds = time.perf_counter() - t0
        self._stage_s += seconds
        metrics = {f"eval/{k}": v for k, v in summarize_generations(gen, self.settings).items()}
        metrics["eval/num_items"] = int(metrics["eval/num_items"])
        metrics["perf/eval_s"] = seconds
        metrics["perf/eval_tok_s"] = sum(gen.lengths) / max(gen.generate_s, 1e-9)
        record = {"kind": "eval", "stage": state.stage, "update": state.update,
                  "update_in_stage": state.update_in_stage, "time_s": time.perf_counter() - self.trainer.t_start,
                  **metrics}
        self.logger.log(record)
        if self.world.is_main:
            self.progress.eval_summary(state.update, metrics)
        return seconds


def _gather(gen: Generations, settings: EvalSettings, world) -> Generations:
    """Concatenate every rank's per-item outcomes (identity in a single process).

    ``generate_s`` stays this rank's own, so tokens / generate_s is the ranks' combined rate.
    """
    if world.size == 1:
        return gen

    def cat(values, dtype=torch.float64):
        return dist.gather_cat(torch.tensor(values, dtype=dtype))

    # Every rank joins (a rank may have no items, hence no counts); {} when no rank evaluated through an env.
    out = Generations(generate_s=gen.generate_s, env_counts=dist.sum_named_over_ranks(gen.env_counts))
    if gen.greedy is not None:
        out.greedy = cat(gen.greedy).tolist()
    if gen.samples is not None:
        flat = cat([x for row in gen.samples for x in row])
        out.samples = flat.view(-1, settings.n).tolist()
    out.lengths = cat(gen.lengths, torch.long).tolist()
    out.truncated = cat(gen.truncated, torch.bool).tolist()
    return out
