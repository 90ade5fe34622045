"""Environments that do what a hostile or careless user's would: a huge reset prompt, a process exit
inside a step (used by tests/rollout/envs/ and tests/rollout/test_calls_env.py)."""
import os

from mugrpo.rollout.envs.base import Environment, StepResult


class HugeReset(Environment):
    """``reset`` gives a 10 MB user message for items whose question has an odd length (the others: the
    task's prompt); one step, done."""
    max_turns = 1

    def reset(self, item, seed):
        if len(item.question) % 2:
            return [{"role": "user", "content": "7" * 10_000_000}]
        return None

    def step(self, action):
        return StepResult([], reward=0.0, done=True)
