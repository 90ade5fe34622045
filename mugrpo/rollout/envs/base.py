"""The environment interface: what the multi-turn rollout loop drives.

The convention is skyrl-gym's ``BaseTextEnv``: the decoded text of one policy turn goes in; the
chat messages to append, a reward and a done flag come out. textarena games, TRL ``tools=`` and
TRL ``environment_factory`` objects map onto it through thin adapters (:mod:`.tools`,
:mod:`.builtin`).

Token bookkeeping is deliberately NOT here: the rollout loop keeps the engine's sampled token ids
exactly and tokenizes each environment turn once (:mod:`.render`). An environment only sees and
returns text.

One instance serves one trajectory (the loop calls an :data:`EnvFactory` per trajectory), and it
must be deterministic given ``(item, seed)``: resume replays stages bitwise on that assumption.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["StepResult", "Environment", "EnvFactory"]


@dataclasses.dataclass
class StepResult:
    """What one environment step returns to the loop."""

    observations: list[dict]
    """Chat messages to append: ``{"role": "user"|"tool", "content": str, ["name": str]}``; [] when done."""
    reward: float = 0.0
    """This step's reward; a trajectory's environment reward is the sum over its steps."""
    done: bool = False
    metadata: dict = dataclasses.field(default_factory=dict)
    """Counted/logged by the loop (e.g. ``tool_calls``, ``tool_errors``)."""


class Environment:
    """One instance per trajectory (made by a factory); deterministic given ``(item, seed)``."""

    max_turns: int = 4
    """Policy turns at most (the loop also has a token budget)."""
    stop: tuple[str, ...] = ()
    """Strings that end a policy turn early (e.g. ``"</tool_call>"``); EOS always does."""

    def reset(self, item, seed: int) -> list[dict] | None:
        """Start a trajectory on ``item`` (a :class:`mugrpo.rollout.tasks.Item`).

        Returns the prompt messages, or None for the task's usual prompt.
        """
        return None

    def step(self, action: str) -> StepResult:
        """Take the decoded text of one policy turn; return what to append, the reward, done."""
        raise NotImplementedError

    def tools(self) -> list[Callable]:
        """Callables rendered into the prompt (the chat template's ``tools=`` or the text protocol)."""
        return []

    def close(self) -> None:
        """Release what the environment holds (called once, also after an error)."""

    def metrics(self) -> dict[str, float]:
        """Numbers summed over trajectories by the loop and logged as ``env/<key>``."""
        return {}


EnvFactory = Callable[[], Environment]
"""Makes a fresh :class:`Environment` for one trajectory."""
