"""A hostile environment for tests/training/test_hostile_environment.py (importable by its path in a config)."""
from mugrpo.rollout.envs.base import Environment, StepResult


class Flaky(Environment):
    """Its constructor raises on its 3rd and 30th instances, its step raises on every 5th
    step, its close raises always, its metadata carries a NaN; otherwise TryAgain's game."""

    max_turns = 3
    stop = ("1",)
    made = 0
    steps = 0

    def __init__(self):
        Flaky.made += 1
        if Flaky.made in (3, 30):
            raise RuntimeError(f"constructor broke (instance {Flaky.made})")
        self.n = 0

    def step(self, action):
        Flaky.steps += 1
        if Flaky.steps % 5 == 0:
            raise ValueError("step broke")
        self.n += 1
        ones = action.count("1")
        if ones >= 2 or self.n >= 3:
            return StepResult([], reward=0.1 * ones, done=True, metadata={"odd": float("nan")})
        return StepResult([{"role": "user", "content": "more"}], reward=0.0, metadata={"odd": float("nan")})

    def close(self):
        raise OSError("close broke")
