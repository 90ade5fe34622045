"""Environments that score themselves, for tests/evaluation/test_environment_eval.py (``task.env=self_scoring_envs:...``).
Every printable character is a stop string, so each policy turn of the tiny model is about one token."""
import string

from mugrpo.rollout.envs.base import Environment, StepResult


class OneEighth(Environment):
    """One turn, environment reward 0.125 (the issue's run: task reward 0, environment reward 0.125)."""
    max_turns = 1
    stop = tuple(string.printable)

    def step(self, action):
        return StepResult([], reward=0.125, done=True)


class FiveTurns(Environment):
    """Done, with reward 1, at its fifth step; every step before answers 'go on' (a tool result)."""
    max_turns = 5
    stop = tuple(string.printable)

    def __init__(self, **kw):
        self.n = 0

    def step(self, action):
        self.n += 1
        if self.n == 5:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "go on"}], reward=0.0)
