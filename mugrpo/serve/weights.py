"""What a rollout service checks before it loads a weights version: the file lies in its weights folder,
and it holds exactly the model's parameters (every name once, none unknown, none missing, shapes and dtypes
equal). Nothing here changes a model; the engines' loaders (:mod:`mugrpo.serve.hf_app`,
:mod:`mugrpo.serve.vllm_app`) call these checks first, and again on the tensors they read, so a version
loads whole or not at all.

A spec is ``{name: (shape, dtype)}``, dtype as torch names it ("float32", "bfloat16"). The trainer pushes
the plain HF model's ``named_parameters()`` (LoRA merged in, tied weights listed once, no buffers) in the
service's dtype (``RemoteEngine._write``); :func:`spec_of_parameters` gives the same list for the model
the service holds.

This module knows nothing about HTTP or engines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

Spec = Mapping[str, tuple[tuple[int, ...], str]]

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class WeightsRefused(Exception):
    """A load refused before any parameter changed; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def files_inside(weights_dir: str, path: str) -> list[Path]:
    """The safetensors file(s) ``path`` names, each resolved (symlinks followed) inside ``weights_dir``.

    ``path`` is a file or folder name relative to the folder, or a full path into it. Anything that
    resolves elsewhere is refused (403) before it is opened or even tested for existence, and no message
    names the folder, so a client learns nothing about the file system."""
    root = os.path.realpath(weights_dir)
    target = os.path.realpath(os.path.join(root, path))  # an absolute path replaces root here
    if os.path.commonpath([root, target]) != root or target == root:
        raise WeightsRefused(403, f"load_weights: path {os.path.basename(path)!r} is not inside the service's "
                                  "--weights-dir (the trainer's rollout.remote.weights_dir must be that folder)")
    if os.path.isdir(target):
        files = sorted(Path(target).glob("*.safetensors"))
        outside = [f.name for f in files if os.path.commonpath([root, os.path.realpath(f)]) != root]
        if outside:
            raise WeightsRefused(403, f"load_weights: {outside[0]} links outside the service's --weights-dir")
    else:
        files = [Path(target)] if os.path.isfile(target) else []
    if not files:
        raise WeightsRefused(404, f"load_weights: no safetensors file at {os.path.basename(path)!r} in the "
                                  "service's --weights-dir (is it the trainer's rollout.remote.weights_dir?)")
    return files


def spec_of_parameters(named_parameters: Iterable) -> dict[str, tuple[tuple[int, ...], str]]:
    """The spec of ``model.named_parameters()`` (torch dtypes' names without the ``torch.`` prefix)."""
    return {name: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in named_parameters}


def spec_of_config(model_path: str, dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The spec of the HF model at ``model_path`` in ``dtype``, built on the meta device (no memory, no
    weights read): what the trainer pushes to a vLLM service, whose own model has vLLM's fused names."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return spec_of_parameters(model.named_parameters())


def header_of_files(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's (shape, dtype) from the files' safetensors headers (no tensor is read); a name in two
    files, or a file that is not safetensors, is refused (400)."""
    from safetensors import safe_open

    seen: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    if name in seen:
                        raise WeightsRefused(400, f"load_weights: tensor {name!r} is in both {where[name]} and "
                                                  f"{f.name}; each parameter must appear once")
                    piece = handle.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), piece.get_dtype())
                    seen[name], where[name] = (tuple(piece.get_shape()), dtype), f.name
        except WeightsRefused:
            raise
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file is not what it should be
            raise WeightsRefused(400, f"load_weights: {f.name} is not a readable safetensors file "
                                      f"({type(exc).__name__})") from None
    return seen


def check_against(found: Spec, spec: Spec) -> None:
    """Refuse (400, naming the first problem) unless ``found`` has exactly ``spec``'s names, shapes and dtypes."""
    unknown = [name for name in found if name not in spec]
    if unknown:
        raise WeightsRefused(400, f"load_weights: tensor {unknown[0]!r} is not a parameter of the served model "
                                  f"({len(unknown)} unknown name(s)); is the file from another model?")
    missing = [name for name in spec if name not in found]
    if missing:
        raise WeightsRefused(400, f"load_weights: {len(missing)} of the model's {len(spec)} parameters are "
                                  f"missing, the first {missing[0]!r}; a version must hold every parameter")
    for name, (shape, dtype) in spec.items():
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != tuple(shape):
            raise WeightsRefused(400, f"load_weights: tensor {name!r} has shape {list(got_shape)}, the model's "
                                      f"parameter has {list(shape)}")
        if got_dtype != dtype:
            raise WeightsRefused(400, f"load_weights: tensor {name!r} is {got_dtype}, the service runs in "
                                      f"{dtype} (the trainer's rollout.dtype must equal the service's --dtype)")


def check_tensors(tensors: Mapping, spec: Spec) -> None:
    """:func:`check_against` on tensors already read (the second check, on what will actually be loaded)."""
    check_against(spec_of_parameters(tensors.items()), spec)
