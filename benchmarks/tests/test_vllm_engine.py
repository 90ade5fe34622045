"""benchmarks/vllm_engine.py on the default rollout.dtype=auto: the engines get the
dtype training would resolve, never "auto" (the HF engine raised KeyError: 'auto')."""
import pytest

from benchmarks import vllm_engine
from mugrpo.config import Config
from mugrpo.hardware import detect, resolve
from mugrpo.rollout.engines.hf import _DTYPES

pytestmark = pytest.mark.bench  # a benchmark's bookkeeping: `pytest -m bench benchmarks/tests` runs it


def test_the_benchmark_resolves_auto_as_training_does():
    assert Config().rollout.dtype == "auto"  # the benchmark's --dtype default
    cfg = vllm_engine.job_config("auto")
    assert cfg.rollout.dtype in _DTYPES  # what the HF engine can load
    assert cfg.rollout.dtype == resolve(cfg.train.autocast, "auto", "hf", detect()).engine_dtype
    assert vllm_engine.job_config("float16").rollout.dtype == "float16"  # a given dtype is kept
