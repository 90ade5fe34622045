"""The ``auto`` settings resolved per machine: bf16 only where the device computes it natively."""
import pytest

from mugrpo.config import load_config
from mugrpo.hardware import Hardware, detect, resolve
from mugrpo.config.plan import format_plan, make_plan

pytestmark = pytest.mark.unit

AVX512_BF16 = Hardware("cpu", "AVX512", native_bf16=True, vllm_available=True)
AVX2 = Hardware("cpu", "AVX2", native_bf16=False, vllm_available=False)


def test_auto_is_bf16_only_with_native_bf16():
    fast = resolve("auto", "auto", "auto", AVX512_BF16)
    assert (fast.autocast, fast.engine_dtype, fast.engine, fast.notes) == ("bf16", "bfloat16", "vllm", [])
    slow = resolve("auto", "auto", "auto", AVX2)
    assert (slow.autocast, slow.engine_dtype, slow.engine) == ("none", "float32", "hf")
    assert len(slow.notes) == 1 and "vLLM is not installed" in slow.notes[0]


def test_engine_dtype_auto_follows_the_trainer():
    # An explicit float32 trainer on a bf16 machine samples in float32 too (exact ratio 1 at stage start).
    assert resolve("none", "auto", "hf", AVX512_BF16).engine_dtype == "float32"
    assert resolve("bf16", "auto", "hf", AVX512_BF16).engine_dtype == "bfloat16"


@pytest.mark.parametrize("autocast,dtype,key", [("bf16", "float32", "train.autocast=bf16"),
                                                ("none", "bfloat16", "rollout.dtype=bfloat16")])
def test_explicit_bf16_without_native_support_is_kept_with_a_warning(autocast, dtype, key):
    r = resolve(autocast, dtype, "hf", AVX2)
    assert (r.autocast, r.engine_dtype) == (autocast, dtype)  # the user's choice stands
    assert len(r.notes) == 1 and key in r.notes[0] and "23x slower" in r.notes[0]


def test_plan_prints_the_resolved_values():
    cfg = load_config("mu-grpo")
    text = format_plan(make_plan(cfg), cfg, resolve("auto", "auto", "auto", AVX2))
    assert "float32 (train.autocast=auto)" in text and "hf, float32 (rollout.engine=auto" in text
    assert "capability AVX2, no native bf16" in text


def test_detect_reports_this_machine():
    import torch

    hw = detect()
    assert hw.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert hw.device == ("cuda" if torch.cuda.is_available() else "cpu")
