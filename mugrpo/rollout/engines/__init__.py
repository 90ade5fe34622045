"""Rollout engines behind one small interface (see :mod:`mugrpo.rollout.engines.base`).

:data:`ENGINES` is the registry (:class:`mugrpo.registry.Registry`, as every extension axis): the
names ``rollout.engine`` and ``mugrpo eval --engine`` accept, and where each implementation lives.
A new engine is a module implementing :class:`~mugrpo.rollout.engines.base.RolloutEngine` plus one
line here (or ``ENGINES.register(name, cls)`` from a user's code). Implementations are imported only
when built, so ``import mugrpo`` never needs vLLM; and this file imports nothing heavy itself (the
config reads the names), so the interface types are loaded on first use.
"""

from __future__ import annotations

import dataclasses
import importlib

from mugrpo.registry import Registry

ENGINES = Registry("rollout.engine", {
    "hf": "mugrpo.rollout.engines.hf:HFEngine",
    "vllm": "mugrpo.rollout.engines.vllm:VLLMEngine",
    "remote": "mugrpo.rollout.engines.remote:RemoteEngine",
})

__all__ = ["ENGINES", "Completion", "RolloutEngine", "SamplingConfig", "build_engine", "make_engine",
           "weights_loaded"]
_FROM_BASE = {"Completion", "RolloutEngine", "SamplingConfig", "weights_loaded"}


def make_engine(kind: str, model_path: str, tokenizer, rollout_cfg, seed: int = 0, **options):
    """Build the engine registered as ``kind`` for the HF model folder ``model_path``; ``options`` are
    that engine's own keyword arguments."""
    return ENGINES.get(kind)(model_path, tokenizer, rollout_cfg, seed=seed, **options)


def build_engine(resolved, model_path: str, tokenizer, rollout_cfg, seed: int = 0, prompt_tokens: int | None = None):
    """The rollout engine for this machine: ``resolved``'s engine kind and engine dtype (the ``auto``
    choices made by :func:`mugrpo.hardware.resolve`), otherwise ``rollout_cfg``. Training and
    ``mugrpo eval`` both build theirs here. ``prompt_tokens``: the longest prompt the run will send,
    when known; the vLLM engine sizes its CPU KV cache by it (``rollout.vllm.kv_cache_gb: auto``)."""
    rollout_cfg = dataclasses.replace(rollout_cfg, dtype=resolved.engine_dtype)
    if resolved.engine == "vllm":
        return make_engine("vllm", model_path, tokenizer, rollout_cfg, seed=seed, prompt_tokens=prompt_tokens)
    return make_engine(resolved.engine, model_path, tokenizer, rollout_cfg, seed=seed)


def __getattr__(name: str):
    if name in _FROM_BASE:
        return getattr(importlib.import_module("mugrpo.rollout.engines.base"), name)
    raise AttributeError(f"module 'mugrpo.rollout.engines' has no attribute {name!r}")
