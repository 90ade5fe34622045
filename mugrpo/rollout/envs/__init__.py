"""Environments for multi-turn and tool-using rollouts.

- :mod:`.base`: the interface (skyrl-gym's ``BaseTextEnv`` shape): ``reset``, ``step`` -> StepResult.
- :mod:`.tools`: the ``<tool_call>`` protocol, ``tools=`` and TRL
  ``environment_factory`` environments.
- :mod:`.render`: token ids of the prompt with tools and of each environment turn (once).
- :mod:`.builtin`: calculator, multi-attempt feedback, the skyrl-gym adapter.
- :mod:`.build`: the per-trajectory factory from the config; :mod:`.start`: a stage's trajectories.

The built-ins are named in :data:`mugrpo.rollout.ENVIRONMENTS` (``task.env``; re-exported here);
:func:`env_factory` makes the per-trajectory factory of a name.
"""

from __future__ import annotations

import functools

from mugrpo.registry import RegistryError
from mugrpo.rollout import ENVIRONMENTS
from mugrpo.rollout.envs.base import EnvFactory, Environment, StepResult

__all__ = ["EnvFactory", "Environment", "StepResult", "ENVIRONMENTS", "env_factory"]


def env_factory(name: str, **kwargs) -> EnvFactory:
    """The factory of the environment ``name`` (registered in :data:`ENVIRONMENTS`), each call making
    a fresh instance with ``kwargs``. Arguments are checked now, by making one."""
    try:
        cls = ENVIRONMENTS.get(name)
    except RegistryError as exc:
        raise ValueError(str(exc)) from exc
    factory = functools.partial(cls, **kwargs)
    try:
        factory().close()
    except TypeError as exc:
        raise ValueError(f"environment {name!r} with arguments {kwargs}: {exc}") from exc
    return factory
