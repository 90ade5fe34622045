"""A stage's generation when the task has an environment: trajectories in, stage data out.

The trainer's generation phase calls :func:`generate_env_stage` instead of one ``engine.generate``
when ``task.env`` / ``task.tools`` give an environment factory. It starts G environments per drawn
item (the prompt-length rule applied to their prompts before anything is generated), runs the
multi-turn loop (:mod:`mugrpo.rollout.multiturn`) and returns the trajectories with what the
trainer's scoring needs: the text to score per trajectory (its final policy turn), the environment
rewards to add, the per-token ``turns`` for the stage data, and the loop's counts.

Reward of a trajectory = the sum of its environment step rewards + the task's rewards
(``task.rewards`` / ``reward_fn`` / correctness) on the text of its final policy turn
(docs/ENVIRONMENTS.md, Rewards); the trainer adds the two.

This module knows nothing about scoring, the update, checkpoints or logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.multiturn import LoopLimits, Trajectory, loop_counts, roll_out_items
from mugrpo.rollout.tasks import limit_prompts


@dataclass
class EnvStage:
    indices: list[int]
    """The task item of each group (after the prompt-length rule)."""
    prompts: list[list[int]]
    trajectories: list[Trajectory]
    """G per group, group-major."""

    @property
    def counts(self) -> dict[str, float]:
        """:func:`mugrpo.rollout.multiturn.loop_counts` (sum over ranks, then ``finalize_counts``)."""
        return loop_counts(self.trajectories)

    @property
    def env_rewards(self) -> torch.Tensor:
        """[groups * G] float32: each trajectory's summed environment step rewards."""
        return torch.tensor([t.env_reward for t in self.trajectories], dtype=torch.float32)

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
        """What the task's rewards score: each trajectory's final policy turn."""
        return [t.final_text for t in self.trajectories]


def generate_env_stage(engine, factory, task, tokenizer, task_cfg, indices: list[int], sampling: SamplingConfig,
                       limits: LoopLimits, reset_seed: int, progress=None) -> EnvStage:
    """Roll out G = ``sampling.n`` trajectories for each of ``indices`` (task items).

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
    return EnvStage([indices[g] for g in kept], prompts, trajs)
