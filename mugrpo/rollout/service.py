"""What the trainer's remote engine (:mod:`mugrpo.rollout.engines.remote`) and a rollout service
(``mugrpo serve``, :mod:`mugrpo.serve`) must agree on: the model and tokenizer fingerprints a client checks
at connection, and the weights folder both default to.

The service's routes and their bodies are in docs/SERVING.md ("The protocol"); the service itself is in
:mod:`mugrpo.serve`.

This module imports neither torch nor an HTTP library at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype",
                         "_commit_hash", "use_cache"}
"""Config keys that differ between copies of one architecture (where it was saved from, the dtype it was
saved in): left out of :func:`model_fingerprint`, which the weights pushed every stage make sufficient."""


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
