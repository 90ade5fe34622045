"""What the trainer's remote engine (:mod:`mugrpo.rollout.engines.remote`) and a rollout service
(``mugrpo serve``, :mod:`mugrpo.serve`) must agree on: the model and tokenizer fingerprints a client checks
at connection, and the weights folder both default to.

The service's routes and their bodies are in docs/SERVING.md ("The protocol"); the service itself is in
:mod:`mugrpo.serve`. The old ``/generate`` wire format (``sampling_to_json``, ``completions_from_json``)
stays until the remote engine speaks ``/v1/completions``.

This module imports neither torch nor an HTTP library at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from typing import Any

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype",
                         "_commit_hash", "use_cache"}
"""Config keys that differ between copies of one architecture (where it was saved from, the dtype it was
saved in): left out of :func:`model_fingerprint`, which the weights pushed every stage make sufficient."""

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "stop")


def default_weights_dir() -> str:
    """``/dev/shm/mugrpo-weights`` where ``/dev/shm`` exists, else ``mugrpo-weights`` in the system temp
    folder: the default of the trainer's ``rollout.remote.weights_dir`` and of the service's
    ``--weights-dir``, so both sides agree without a flag."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, "mugrpo-weights")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (16 hex digits) of the vocabulary, the special tokens and the pad / EOS ids: two tokenizers
    with one fingerprint turn text into the same ids."""
    data = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens),
            "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_fingerprint(model_path: str, trust_remote_code: bool = False) -> str:
    """sha256 (16 hex digits) of the model's config, where it was saved from and its dtype aside: the
    architecture the pushed weights must fit."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()
    kept = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


# -- the wire format (both sides) ----------------------------------------------------------------------

def sampling_to_json(sampling) -> dict:
    return {k: (list(v) if k == "stop" else v) for k, v in asdict(sampling).items()}


def sampling_from_json(data: Any):
    from mugrpo.rollout.engines.base import SamplingConfig

    if not isinstance(data, dict) or set(data) - set(SAMPLING_FIELDS):
        raise ValueError(f"'sampling' must be an object with keys among {', '.join(SAMPLING_FIELDS)}")
    values = dict(data)
    if "stop" in values:
        values["stop"] = tuple(values["stop"])
    return SamplingConfig(**values)


def completions_to_json(completions: list) -> list:
    return [[{"token_ids": c.token_ids, "logprobs": c.behavior_logprobs, "finish_reason": c.finish_reason}
             for c in group] for group in completions]


def completions_from_json(data: Any, num_prompts: int, n: int) -> list:
    """Check an answer's shape (``num_prompts`` groups of ``n``, one log-prob per token, int ids, a known
    finish reason) and build the completions; ValueError names what is wrong."""
    from mugrpo.rollout.engines.base import Completion

    if not isinstance(data, list) or len(data) != num_prompts:
        raise ValueError(f"expected {num_prompts} groups of completions, got "
                         f"{len(data) if isinstance(data, list) else type(data).__name__}")
    out = []
    for i, group in enumerate(data):
        if not isinstance(group, list) or len(group) != n:
            raise ValueError(f"prompt {i}: expected {n} completions")
        row = []
        for j, c in enumerate(group):
            ids, logprobs = (c.get("token_ids"), c.get("logprobs")) if isinstance(c, dict) else (None, None)
            if not (isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs)
                    and all(type(t) is int for t in ids) and all(isinstance(x, (int, float)) for x in logprobs)):
                raise ValueError(f"prompt {i}, completion {j}: token_ids and logprobs must be lists of equal "
                                 "length (ints and numbers)")
            if c.get("finish_reason") not in ("stop", "length"):
                raise ValueError(f"prompt {i}, completion {j}: finish_reason {c.get('finish_reason')!r}")
            row.append(Completion(ids, [float(x) for x in logprobs], c["finish_reason"]))
        out.append(row)
    return out
