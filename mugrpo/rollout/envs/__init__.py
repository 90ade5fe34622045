"""Environments for multi-turn and tool-using rollouts.

- :mod:`.base`: the interface (skyrl-gym's ``BaseTextEnv`` shape): ``reset``, ``step`` -> StepResult.
- :mod:`.tools`: the ``<tool_call>`` protocol, the bounded tool pool, ``tools=`` and TRL
  ``environment_factory`` environments.
- :mod:`.render`: token ids of the prompt with tools and of each environment turn (once).
- :mod:`.builtin`: calculator, multi-attempt feedback, the skyrl-gym adapter.

:data:`ENVIRONMENTS` names the built-ins (name -> ``"module:attr"``, imported on use);
:func:`env_factory` makes the per-trajectory factory the rollout loop calls.
"""

from __future__ import annotations

import functools
import importlib

from mugrpo.rollout.envs.base import EnvFactory, Environment, StepResult

__all__ = ["EnvFactory", "Environment", "StepResult", "ENVIRONMENTS", "env_factory"]

ENVIRONMENTS = {
    "calculator": "mugrpo.rollout.envs.builtin:CalculatorEnvironment",
    "multi_attempt": "mugrpo.rollout.envs.builtin:MultiAttemptEnvironment",
    "skyrl_gym": "mugrpo.rollout.envs.builtin:SkyRLGymEnvironment",
}


def env_factory(name: str, **kwargs) -> EnvFactory:
    """The factory of the environment ``name`` (a key of :data:`ENVIRONMENTS` or ``"module:attr"``),
    each call making a fresh instance with ``kwargs``. Arguments are checked now, by making one."""
    target = ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown environment {name!r}: use one of {sorted(ENVIRONMENTS)} or 'module:attr'")
    module, attr = target.split(":", 1)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {name!r}: cannot import {target!r} ({exc})") from exc
    factory = functools.partial(cls, **kwargs)
    try:
        factory().close()
    except TypeError as exc:
        raise ValueError(f"environment {name!r} with arguments {kwargs}: {exc}") from exc
    return factory
