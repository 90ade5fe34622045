"""Rollout engines behind one small interface (see :mod:`mugrpo.engines.base`).

``make_engine`` imports the chosen implementation lazily, so ``import mugrpo`` never needs vLLM.
"""

from __future__ import annotations

from mugrpo.engines.base import Completion, RolloutEngine, SamplingConfig

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "make_engine"]


def make_engine(kind: str, model_path: str, tokenizer, rollout_cfg, seed: int = 0) -> RolloutEngine:
    """Build the engine named ``kind`` ("hf" or "vllm") for the HF model folder ``model_path``."""
    if kind == "hf":
        from mugrpo.engines.hf import HFEngine

        return HFEngine(model_path, tokenizer, rollout_cfg, seed=seed)
    if kind == "vllm":
        from mugrpo.engines.vllm import VLLMEngine

        return VLLMEngine(model_path, tokenizer, rollout_cfg, seed=seed)
    raise ValueError(f"unknown rollout engine {kind!r}; choose 'hf' or 'vllm'")
