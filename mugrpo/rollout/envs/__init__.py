"""Environments for multi-turn and tool-using rollouts (the interface is in :mod:`.base`)."""

from mugrpo.rollout.envs.base import EnvFactory, Environment, StepResult

__all__ = ["EnvFactory", "Environment", "StepResult"]
