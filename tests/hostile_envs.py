"""Environments that do what a hostile or careless user's would: a huge reset prompt, a process exit
inside a step or a tool, a tool that never returns (used by tests/rollout/envs/)."""
import json
import os

import guard_tools
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.envs.tools import ToolEnvironment


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


class ForcedTool(ToolEnvironment):
    """A tool environment for the tiny random model, which writes no ``<tool_call>``: every step calls
    ``tool`` (``add``, ``die``: ``os._exit(3)``, or ``backtrack``: a catastrophic regex that never
    returns) whatever the model wrote, through :class:`ToolEnvironment`'s own parser and runner."""

    ARGUMENTS = {"add": {"a": 1, "b": 2}, "die": {"x": 0}, "backtrack": {"n": 40}}

    def __init__(self, tool: str = "add", max_turns: int = 2, timeout_s: float = 1.0):
        super().__init__([getattr(guard_tools, tool)], max_turns, timeout_s)  # one: a short protocol text
        self.tool = tool

    def step(self, action):
        call = json.dumps({"name": self.tool, "arguments": self.ARGUMENTS[self.tool]})
        return super().step(f"<tool_call>{call}</tool_call>")
