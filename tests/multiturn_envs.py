from mugrpo.rollout.envs.base import Environment, StepResult
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
