"""Rollout engines behind one small interface (see :mod:`mugrpo.rollout.engines.base`).

:data:`ENGINES` is the registry: the names ``rollout.engine`` and ``mugrpo eval --engine`` accept,
and where each implementation lives. A new engine is a module implementing
:class:`~mugrpo.rollout.engines.base.RolloutEngine` plus one line here. Implementations are imported only
when built, so ``import mugrpo`` never needs vLLM; and this file imports nothing heavy itself
(the config reads the names), so the interface types are loaded on first use.
"""

from __future__ import annotations

import importlib

ENGINES = {
    "hf": "mugrpo.rollout.engines.hf:HFEngine",
    "vllm": "mugrpo.rollout.engines.vllm:VLLMEngine",
}

__all__ = ["ENGINES", "Completion", "RolloutEngine", "SamplingConfig", "make_engine", "weights_loaded"]
_FROM_BASE = {"Completion", "RolloutEngine", "SamplingConfig", "weights_loaded"}


def make_engine(kind: str, model_path: str, tokenizer, rollout_cfg, seed: int = 0):
    """Build the engine registered as ``kind`` for the HF model folder ``model_path``."""
    if kind not in ENGINES:
        raise ValueError(f"unknown rollout engine {kind!r}; choose one of {', '.join(ENGINES)}")
    module, name = ENGINES[kind].split(":")
    return getattr(importlib.import_module(module), name)(model_path, tokenizer, rollout_cfg, seed=seed)


def __getattr__(name: str):
    if name in _FROM_BASE:
        return getattr(importlib.import_module("mugrpo.rollout.engines.base"), name)
    raise AttributeError(f"module 'mugrpo.rollout.engines' has no attribute {name!r}")
