"""Evaluating a policy: generate with a rollout engine, score with the task, summarise.

Two users: ``mugrpo eval`` (:mod:`mugrpo.evaluation.cli`) and the training loop, through
:class:`mugrpo.training.evaluator.TrainingEvaluator`, which decides when an evaluation is due
(``eval.*`` config), pushes the current weights to the engine, logs a ``kind: eval`` record and
keeps the seconds spent for the stage record's ``perf/eval_s``. This module sits below training
(docs/ARCHITECTURE.md): it knows engines, tasks and the multi-turn loop, not the trainer.

Greedy responses use temperature 0; sampled ones use the eval temperature with top-p and top-k
off, and a fixed seed, so every evaluation of a run draws from the same random stream and the
differences between evaluations come from the weights. The engine's sampling never touches the
trainer's RNG (engines fork it), so evaluating does not change the training run.

With an environment (``task.env`` / ``task.tools``: :class:`EnvEval`), each response is a
multi-turn trajectory (:mod:`mugrpo.rollout.multiturn`, the prompts rendered by the environment
with its tools) and the task scores its final policy turn (``greedy_acc``, ``avg_at_n``,
``pass_at_k``: the task's score only); the environment's reward is reported beside it per mode
(``greedy_env_reward_mean``), with the reward training optimises (task score + environment reward,
``greedy_reward_mean``) and the fraction of trajectories whose reward reaches ``correct_at``
(``greedy_solved_frac``; ``sample_*`` likewise); the loop's counts are reported as ``env/*`` (e.g.
``eval/env/tool_calls``). An item whose environment cannot be made or reset (an exception, a
timeout: :mod:`mugrpo.rollout.envs.start`) is skipped in that mode, as training skips it, and
counted in ``env/num_items_skipped`` (item starts, summed over the modes, like
``env/num_trajectories``), the first failure printed; the metrics are then over the other items. An
evaluation where every item failed stops (:func:`stop_if_nothing_started`, after the ranks' counts
are combined) naming the environment and the first error.

The metric math lives in :mod:`mugrpo.evaluation.metrics`; which items to evaluate in
:mod:`mugrpo.evaluation.sets`. Scoring is the task's own (:meth:`mugrpo.rollout.tasks.Task.score_all`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from mugrpo.errors import TaskError
from mugrpo.rollout.engines import SamplingConfig
from mugrpo.rollout.envs.start import Skips, env_name
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, finalize_counts, loop_counts, roll_out_items
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
    keep_text: bool = False
    """Keep every response's text and score (``Generations.records``; ``mugrpo eval --samples``)."""


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
    env_rewards: dict[str, list[float]] = field(default_factory=dict)
    """With an environment, per mode (``greedy``, ``sample``): each response's environment reward."""
    rewards: dict[str, list[float]] = field(default_factory=dict)
    """With an environment, per mode: each response's reward as training counts it (the task's score
    of the final turn plus the environment's reward)."""
    env_failures: list[str] = field(default_factory=list)
    """With an environment: what failed, per item start skipped in this process (with its traceback)."""


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
                       env: Optional[EnvEval] = None) -> Generations:
    """Greedy and/or n sampled responses per item, scored by ``task`` (``env``: multi-turn
    trajectories; ``prompts`` are then the environment's, rendered here)."""
    out = Generations()
    if env is not None:  # the same keys on every rank, also one without items (gathered by the trainer)
        modes = ["greedy"] * settings.greedy + ["sample"] * bool(settings.n)
        out.env_rewards, out.rewards = {m: [] for m in modes}, {m: [] for m in modes}
    if not items:
        out.greedy = [] if settings.greedy else None
        out.samples = [] if settings.n else None
        return out
    runs = _runs(settings)
    for mode, sampling in runs:
        t0 = time.perf_counter()
        responses = _Responses(*_responses(engine, tokenizer, items, prompts, sampling, progress, env, out))
        out.generate_s += time.perf_counter() - t0
        _add_mode(out, task, items, (mode, sampling), responses, settings, tokenizer)
    if out.env_failures:
        print(f"[mugrpo] warning: evaluation: {len(out.env_failures)} item start(s) of {len(items) * len(runs)} "
              "skipped, their environment failed to start (counted in env/num_items_skipped; the metrics are over "
              f"the other items). The first:\n{out.env_failures[0]}", file=sys.stderr)
    return out


def generate_and_score_tasks(engine, tokenizer, parts: list[tuple[Task, list[Item], list[list[int]]]],
                             settings: EvalSettings, progress: Optional[Callable[[int], None]] = None
                             ) -> list[Generations]:
    """Single-turn tasks evaluated together: each mode's prompts of every task in ONE engine call (a batch
    of all the items, not one small batch per task), then each task's responses scored by its own task.
    ``parts``: (task, items, prompts) per task; one :class:`Generations` per part, in order. A task's
    ``generate_s`` is its share, by response tokens, of the calls' seconds (its tok/s is the batch's)."""
    outs = [Generations() for _ in parts]
    bounds = [0]
    for _, items, _ in parts:
        bounds.append(bounds[-1] + len(items))
    prompts = [p for _, _, part_prompts in parts for p in part_prompts]
    for mode, sampling in _runs(settings):
        t0 = time.perf_counter()
        groups = engine.generate(prompts, sampling, progress=progress) if prompts else []
        seconds = time.perf_counter() - t0
        tokens = [sum(len(c.token_ids) for g in groups[lo:hi] for c in g) for lo, hi in zip(bounds, bounds[1:])]
        for j, ((task, items, _), out) in enumerate(zip(parts, outs)):
            flat = [c for g in groups[bounds[j]:bounds[j + 1]] for c in g]
            responses = _Responses([tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat],
                                   [len(c.token_ids) for c in flat], [c.finish_reason != "stop" for c in flat],
                                   None, list(range(len(items))))
            out.generate_s += seconds * tokens[j] / max(sum(tokens), 1)
            _add_mode(out, task, items, (mode, sampling), responses, settings, tokenizer)
    for out in outs:  # a task without items: as generate_and_score leaves it
        if out.greedy is None and settings.greedy:
            out.greedy = []
        if out.samples is None and settings.n:
            out.samples = []
    return outs


def _runs(settings: EvalSettings) -> list[tuple[str, SamplingConfig]]:
    """The modes asked for: (``greedy``, temperature 0) and/or (``sample``, n per item)."""
    runs = []
    if settings.greedy:
        runs.append(("greedy", SamplingConfig(n=1, temperature=0.0, max_new_tokens=settings.max_new_tokens,
                                              seed=settings.seed)))
    if settings.n:
        runs.append(("sample", SamplingConfig(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                                              top_k=0, max_new_tokens=settings.max_new_tokens, seed=settings.seed)))
    return runs


@dataclass
class _Responses:
    """One mode's responses to a task's items (:func:`_responses`): sampling.n per kept item, item-major."""

    texts: list[str]
    lengths: list[int]
    truncated: list[bool]
    trajs: Optional[list]
    kept: list[int]


def _add_mode(out: Generations, task: Task, items: list[Item], run: tuple[str, SamplingConfig], r: _Responses,
              settings: EvalSettings, tokenizer) -> None:
    """Score one mode's responses with ``task`` and add them to ``out`` (scores, lengths, records)."""
    mode, sampling = run
    repeated = [items[i] for i in r.kept for _ in range(sampling.n)]
    scores = task.score_eval(r.texts, repeated)[0].tolist() if r.texts else []
    if r.trajs is not None:
        out.env_rewards[mode] = [t.env_reward for t in r.trajs]
        out.rewards[mode] = [float(x) + t.env_reward for x, t in zip(scores, r.trajs)]
    per_item = [scores[j * sampling.n:(j + 1) * sampling.n] for j in range(len(r.kept))]
    if mode == "greedy":
        out.greedy = [row[0] for row in per_item]
    else:
        out.samples = per_item
    out.lengths += r.lengths
    out.truncated += r.truncated
    if settings.keep_text:
        out.records += [{"item": r.kept[i // sampling.n], "mode": mode, "text": text, "score": float(score),
                         **({} if r.trajs is None else trajectory_record(r.trajs[i], tokenizer))}
                        for i, (text, score) in enumerate(zip(r.texts, scores))]


def stop_if_nothing_started(gen: Generations, env: Optional[EnvEval]) -> None:
    """:class:`TaskError` when an evaluation through ``env`` skipped items and started no trajectory
    (every item's environment failed to start), naming the environment and the first error; call it
    on the combined counts (after the ranks' are summed), so every rank decides alike."""
    counts = gen.env_counts
    if env is None or not counts.get("env/num_items_skipped") or counts.get("env/num_trajectories"):
        return
    first = gen.env_failures[0] if gen.env_failures else "(on another rank: see its output)"
    raise TaskError(f"every item of this evaluation failed to start its environment ({env_name(env.factory)}), so "
                    f"nothing was evaluated: {int(counts['env/num_items_skipped'])} item start(s) skipped. The "
                    f"first:\n{first}")


def trajectory_record(t, tokenizer) -> dict:
    """A trajectory, whole, for ``mugrpo eval --samples``: its turns in reading order (``{"role":
    "policy", "turn": k, "text"}`` for what the policy sampled, ``{"role": "environment", "text"}``
    for what the environment appended: tool calls and their results are both visible), how it
    ended, its policy turns and its environment reward. ``text`` (beside it) stays the final policy
    turn, what the task scores."""
    turns, start = [], 0
    for end in range(1, len(t.turns) + 1):
        if end == len(t.turns) or t.turns[end] != t.turns[start]:
            k = t.turns[start]
            text = tokenizer.decode(t.response_ids[start:end], skip_special_tokens=False)
            turns.append({"role": "policy", "turn": k, "text": text} if k >= 0 else {"role": "environment",
                                                                                      "text": text})
            start = end
    return {"turns": turns, "end": t.end_reason, "num_turns": t.num_turns, "env_reward": t.env_reward}


def _responses(engine, tokenizer, items, prompts, sampling, progress, env: Optional[EnvEval], out: Generations
               ) -> tuple[list[str], list[int], list[bool], Optional[list], list[int]]:
    """(texts to score, response lengths, truncated flags, the trajectories or None, the indices of the
    items they answer), sampling.n per item, item-major. With ``env``, the items whose environment
    failed to start are left out (``out.env_failures``, ``env/num_items_skipped``)."""
    if env is None:
        flat = [c for group in engine.generate(prompts, sampling, progress=progress) for c in group]
        return ([tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat],
                [len(c.token_ids) for c in flat], [c.finish_reason != "stop" for c in flat], None,
                list(range(len(items))))
    ctx = LoopContext(engine, tokenizer, env.limits, env.task_cfg)
    skipped = Skips(none_left_stops=False)  # every item failing is decided over the modes and ranks
    kept, _, trajs = roll_out_items(ctx, env.factory, items, sampling, reset_seed=sampling.seed, progress=progress,
                                    skipped=skipped)
    out.env_failures += skipped.failures
    for key, value in {**loop_counts(trajs), "env/num_items_skipped": float(len(skipped.failures))}.items():
        out.env_counts[key] = out.env_counts.get(key, 0.0) + value
    return ([t.final_text for t in trajs], [sum(1 for k in t.turns if k >= 0) for t in trajs],
            [t.truncated for t in trajs], trajs, kept)


def summarize_generations(gen: Generations, settings: EvalSettings) -> dict[str, float]:
    """``summarize`` plus response statistics: the metrics of one task, without a key prefix."""
    metrics = summarize(gen.greedy, gen.samples, [k for k in settings.ks if k <= settings.n], settings.correct_at)
    n_items = len(gen.greedy if gen.greedy is not None else gen.samples or [])
    metrics["num_items"] = n_items
    metrics["response_len_mean"] = sum(gen.lengths) / len(gen.lengths) if gen.lengths else float("nan")
    metrics["truncated_frac"] = sum(gen.truncated) / len(gen.truncated) if gen.truncated else float("nan")
    if gen.env_counts:  # multi-turn: how trajectories ended, turns, tool counts (env/*)
        metrics.update(finalize_counts(gen.env_counts))
    for mode, rewards in gen.rewards.items():  # with an environment: its reward, and the run's reward
        env_rewards = gen.env_rewards[mode]
        metrics[f"{mode}_env_reward_mean"] = sum(env_rewards) / len(env_rewards) if env_rewards else float("nan")
        metrics[f"{mode}_reward_mean"] = sum(rewards) / len(rewards) if rewards else float("nan")
        metrics[f"{mode}_solved_frac"] = (sum(r >= settings.correct_at for r in rewards) / len(rewards)
                                          if rewards else float("nan"))
    return metrics
