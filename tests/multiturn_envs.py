from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.envs.tools import ToolEnvironment
class TryAgain(Environment):
    """Asks for more until the turn has two '1's (reward 0.1 per '1') or three turns were taken."""
    max_turns = 3
    stop = ("1",)
    def __init__(self, **kw): self.n = 0
    def step(self, action):
        self.n += 1
        ones = action.count("1")
        if ones >= 2 or self.n >= 3:
            return StepResult([], reward=0.1 * ones, done=True)
        return StepResult([{"role": "user", "content": "more"}], reward=0.0)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class CallsAdd(ToolEnvironment):
    """A tool environment for a tiny random model, which writes no ``<tool_call>``: its first policy turn
    is answered as if it had called ``add(a=1, b=2)`` (parsed, run by the tool runner and answered as a
    ``role: tool`` message by :class:`ToolEnvironment` itself); the second turn is the final answer."""

    CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'

    def __init__(self, **kw):
        super().__init__([add], max_turns=2)
        self.n = 0

    def step(self, action):
        self.n += 1
        return super().step(self.CALL if self.n == 1 else action)


class SlowTryAgain(TryAgain):
    """TryAgain whose steps take a random 0..20 ms (an unseeded stream): trajectories finish in another order
    every run, while what they contain must not change."""

    def step(self, action):
        import random
        import time

        time.sleep(random.uniform(0.0, 0.02))
        return super().step(action)
