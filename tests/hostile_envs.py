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


class Counting(Environment):
    """Counts its steps (state that must live between calls); done at the third; ``exit_at``: the step
    that calls ``os._exit(5)`` instead; ``spin_at``: the step that loops forever holding the GIL."""
    max_turns = 4
    stop = ("!",)

    def __init__(self, exit_at=None, spin_at=None):
        self.n, self.exit_at, self.spin_at = 0, exit_at, spin_at

    def step(self, action):
        self.n += 1
        if self.n == self.exit_at:
            os._exit(5)
        if self.n == self.spin_at:
            while True:
                pass
        return StepResult([{"role": "user", "content": f"step {self.n}"}], reward=float(self.n), done=self.n >= 3)

    def metrics(self):
        return {"steps_seen": self.n}


class ExitsWhenMade(Environment):
    """Its constructor exits the process."""

    def __init__(self):
        os._exit(9)

    def step(self, action):
        return StepResult([], done=True)
