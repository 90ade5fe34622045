"""A stage's generation when the task has an environment: trajectories in, stage data out.

The trainer's generation phase calls :func:`generate_env_stage` instead of one ``engine.generate``
when ``task.env`` / ``task.tools`` give an environment factory. It starts G environments per drawn
item, runs the multi-turn loop (:mod:`mugrpo.rollout.multiturn`), scores each trajectory and
returns what the single-turn path returns: the stage data (with ``turns``), the texts scored, the
scoring statistics and the loop's counts.

Reward of a trajectory = the sum of its environment step rewards + the task's rewards
(``task.rewards`` / ``reward_fn`` / correctness) on the text of its final policy turn
(docs/ENVIRONMENTS.md, Rewards).

This module knows nothing about the update, checkpoints or logging; advantages are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.multiturn import LoopLimits, Trajectory, loop_metrics, roll_out_items
from mugrpo.rollout.tasks import limit_prompts


@dataclass
class EnvStage:
    indices: list[int]
    """The task item of each group (after the prompt-length rule)."""
    prompts: list[list[int]]
    trajectories: list[Trajectory]
    """G per group, group-major."""
    rewards: torch.Tensor
    """[groups * G] float32: environment reward + the task's rewards on the final policy turn."""
    score_stats: object
    """The task scorer's :class:`mugrpo.rollout.tasks.ScoreStats`."""
    metrics: dict[str, float]
    """:func:`mugrpo.rollout.multiturn.loop_metrics` of the stage."""

    @property
    def responses(self) -> list[list[int]]:
        return [t.response_ids for t in self.trajectories]

    @property
    def behavior_logprobs(self) -> list[list[float]]:
        return [t.behavior_logprobs for t in self.trajectories]

    @property
    def turns(self) -> list[list[int]]:
        return [t.turns for t in self.trajectories]

    @property
    def finished(self) -> torch.Tensor:
        """[groups * G] bool: False where the trajectory was truncated (token budget or context)."""
        return torch.tensor([not t.truncated for t in self.trajectories], dtype=torch.bool)

    @property
    def texts(self) -> list[str]:
        return [t.final_text for t in self.trajectories]


def generate_env_stage(engine, factory, task, tokenizer, task_cfg, indices: list[int], sampling: SamplingConfig,
                       limits: LoopLimits, reset_seed: int, progress=None) -> EnvStage:
    """Roll out G = ``sampling.n`` trajectories for each of ``indices`` (task items) and score them.

    ``task.max_prompt_tokens`` / ``task.prompt_too_long`` apply to the environment's prompts as to
    single-turn ones; ``truncate`` is refused here (cutting a prompt could cut the tool
    instructions), ``skip`` drops those items."""
    G = sampling.n

    def select(prompts: list[list[int]]) -> list[int]:
        if task_cfg.prompt_too_long == "truncate" and any(len(p) > task_cfg.max_prompt_tokens for p in prompts):
            raise ValueError(f"environment prompts exceed task.max_prompt_tokens={task_cfg.max_prompt_tokens}; "
                             "task.prompt_too_long=truncate is not applied to them (it could cut the tool "
                             "instructions): raise the limit or use skip")
        return limit_prompts(prompts, task_cfg, "training")[1]

    kept, prompts, trajs = roll_out_items(engine, factory, [task.items[i] for i in indices], sampling, limits,
                                          group_size=G, reset_seed=reset_seed, tokenizer=tokenizer,
                                          task_cfg=task_cfg, select=select, progress=progress)
    indices = [indices[g] for g in kept]
    flat_items = [task.items[i] for i in indices for _ in range(G)]
    rewards, stats = task.score_all([t.final_text for t in trajs], flat_items)
    rewards = rewards.float() + torch.tensor([t.env_reward for t in trajs], dtype=torch.float32)
    return EnvStage(indices, prompts, trajs, rewards, stats, loop_metrics(trajs))
