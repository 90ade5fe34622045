"""Where a round of a stage's sequences comes from: a sampler, chosen once when the run is built.

- :class:`TextSampler`: single-turn. The items' prompts are tokenised (the prompt-length rule
  applied) and sent to the engine in one ``generate`` call, G samples each.
- :class:`TrajectorySampler`: multi-turn (``task.env`` / ``task.tools``). G environments per item,
  the trajectories rolled out turn by turn (:mod:`mugrpo.rollout.multiturn`); a trajectory is
  scored on its final policy turn, and its environment reward is added (docs/ENVIRONMENTS.md).

Both take the items, the sampling and the round's seeds and return a :class:`Batch`;
:func:`score_batch` turns a batch into stage data (rewards, group advantages) and its record.
:class:`RolloutParts` is what sampling (and evaluation) needs of a run: engine, task, tokenizer,
environment factory. This module knows nothing of stages' persistence, rounds, the update or
checkpoints (:mod:`mugrpo.stages.generation`).

Shapes: N groups, G responses per group.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mugrpo.algo.advantages import group_advantages
from mugrpo.rollout.engines import SamplingConfig
from mugrpo.rollout.envs.start import Skips
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, first_problems, loop_counts, roll_out_items
from mugrpo.rollout.tasks import Task, limit_prompts, prompt_ids
from mugrpo.rollout.rewards import RewardStats
from mugrpo.stages.counts import ScoreCounts
from mugrpo.stages.data import StageData


@dataclass(frozen=True)
class RolloutParts:
    """What generating (and evaluating) on a task needs of a run."""

    engine: Any
    task: Task
    tokenizer: Any
    env_factory: Any = None
    """Makes one environment per trajectory (``task.env`` / ``task.tools``); None: single-turn."""


@dataclass
class Batch:
    """One round's sequences, before scoring: G per group, group-major."""

    indices: list[int]
    """The task item of each group (after the prompt-length rule)."""
    prompts: list[list[int]]
    responses: list[list[int]]
    behavior_logprobs: list[list[float]]
    finished: torch.Tensor
    """[N * G] bool: False where the response was truncated."""
    texts: list[str]
    """What the task's rewards score: the response, or a trajectory's final policy turn."""
    env_rewards: Optional[torch.Tensor] = None
    """[N * G] float32: each trajectory's summed environment step rewards (multi-turn only)."""
    turns: Optional[list[list[int]]] = None
    """Per token: policy turn k >= 0 or -1 for an environment token (multi-turn only)."""
    env_counts: Optional[dict[str, float]] = None
    """:func:`mugrpo.rollout.multiturn.loop_counts` of the trajectories, and ``env/num_items_skipped``
    (items whose environment could not be made or reset; multi-turn only)."""
    env_problems: Optional[dict[str, str]] = None
    """The first failure of each kind (``start_error``, the end reasons, ``close_error``, ...), its traceback."""


def _tokenised(parts: RolloutParts, task_cfg, indices: list[int]) -> tuple[list[int], list[list[int]]]:
    """The items' prompts, tokenised, the length rule applied: (the indices kept, their prompts)."""
    prompts = [prompt_ids(parts.tokenizer, parts.task.items[i].prompt, task_cfg) for i in indices]
    prompts, kept = limit_prompts(prompts, task_cfg, "training")
    return [indices[i] for i in kept], prompts


class TextSampler:
    """Single-turn: one engine call, G samples per prompt."""

    def __init__(self, parts: RolloutParts, task_cfg):
        self.parts, self.task_cfg = parts, task_cfg

    def prompts(self, indices: list[int]) -> tuple[list[int], list[list[int]]]:
        """(the items kept by the prompt-length rule, their tokenised prompts)."""
        return _tokenised(self.parts, self.task_cfg, indices)

    def sample(self, indices: list[int], prompts: list[list[int]], sampling: SamplingConfig,
               on_batch: Callable[[int], None], reset_seed: int) -> Batch:
        completions = self.parts.engine.generate(prompts, sampling, progress=on_batch)
        flat = [c for group in completions for c in group]
        return Batch(indices, prompts, [c.token_ids for c in flat], [c.behavior_logprobs for c in flat],
                     torch.tensor([c.finish_reason == "stop" for c in flat]),
                     [self.parts.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat])


class TrajectorySampler:
    """Multi-turn: G environments per item, rolled out turn by turn.

    ``task.max_prompt_tokens`` / ``task.prompt_too_long`` apply to the environment's prompts (rendered
    by the environment, with its tools) as to single-turn ones; ``truncate`` is refused here (cutting
    a prompt could cut the tool instructions), ``skip`` drops those items."""

    def __init__(self, parts: RolloutParts, task_cfg, limits: LoopLimits):
        self.parts, self.task_cfg = parts, task_cfg
        self.ctx = LoopContext(parts.engine, parts.tokenizer, limits, task_cfg)

    def prompts(self, indices: list[int]) -> tuple[list[int], list[list[int]]]:
        """The environment renders (and length-checks) its own prompts: every item, no prompt yet."""
        return indices, []

    def sample(self, indices: list[int], prompts: list[list[int]], sampling: SamplingConfig,
               on_batch: Callable[[int], None], reset_seed: int) -> Batch:
        skipped = Skips()  # items whose environment failed to start: left out, as too-long prompts are
        kept, prompts, trajs = roll_out_items(self.ctx, self.parts.env_factory,
                                              [self.parts.task.items[i] for i in indices], sampling,
                                              reset_seed=reset_seed, select=self._select, progress=on_batch,
                                              skipped=skipped)
        problems = first_problems(trajs)
        if skipped.failures:
            problems = {"start_error": skipped.failures[0], **problems}
        return Batch([indices[g] for g in kept], prompts, [t.response_ids for t in trajs],
                     [t.behavior_logprobs for t in trajs],
                     torch.tensor([not t.truncated for t in trajs], dtype=torch.bool), [t.final_text for t in trajs],
                     env_rewards=torch.tensor([t.env_reward for t in trajs], dtype=torch.float32),
                     turns=[t.turns for t in trajs],
                     env_counts={**loop_counts(trajs), "env/num_items_skipped": float(len(skipped.failures))},
                     env_problems=problems)

    def _select(self, prompts: list[list[int]]) -> list[int]:
        cfg = self.task_cfg
        if cfg.prompt_too_long == "truncate" and any(len(p) > cfg.max_prompt_tokens for p in prompts):
            raise ValueError(f"environment prompts exceed task.max_prompt_tokens={cfg.max_prompt_tokens}; "
                             "task.prompt_too_long=truncate is not applied to them (it could cut the tool "
                             "instructions): raise the limit or use skip")
        return limit_prompts(prompts, cfg, "training")[1]


def score_batch(batch: Batch, task: Task, group_size: int, loss_cfg, reward_names: list[str]
                ) -> tuple[StageData, dict]:
    """The batch scored: rewards (the task's on each text, plus the environment's), group advantages
    (``loss.adv_std_scale``, ``loss.adv_eps``), as stage data; and the scorer's counts for the record."""
    G = group_size
    rewards, score_stats = task.score_all(batch.texts, [task.items[i] for i in batch.indices for _ in range(G)])
    if batch.env_rewards is not None:
        rewards = rewards + batch.env_rewards
    rewards = rewards.view(len(batch.prompts), G)
    advantages, _ = group_advantages(rewards, std_scale=loss_cfg.adv_std_scale, eps=loss_cfg.adv_eps)
    data = StageData(batch.prompts, batch.responses, batch.behavior_logprobs, rewards.flatten(), advantages.flatten(),
                     batch.finished, batch.indices, G, turns=batch.turns)
    counts = ScoreCounts(score_stats.num_errors, score_stats.num_timeouts, score_stats.num_invalid,
                         score_stats.num_unparsable, score_stats.num_scored,
                         per_reward={name: dataclasses.asdict(score_stats.per_reward.get(name, RewardStats()))
                                     for name in reward_names})
    num_new = sum(data.num_policy_tokens(s) for s in range(len(data.responses)))
    return data, {"counts": counts.as_record(), "num_new_tokens": num_new,
                  "first_error": score_stats.first_error}
