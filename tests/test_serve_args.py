"""``mugrpo serve``'s arguments (mugrpo.serve): what they parse to, and the port checked before any
model loads."""
import argparse

import pytest

from mugrpo import serve
from mugrpo.errors import ConfigError

pytestmark = pytest.mark.unit


def _parser():
    p = argparse.ArgumentParser(prog="mugrpo serve")
    serve.add_arguments(p)
    return p


def test_the_arguments_and_their_defaults():
    args = _parser().parse_args(["--model", "M", "--port", "0", "--engine", "hf"])
    assert vars(args) == {"model": "M", "port": 0, "host": "127.0.0.1", "engine": "hf", "dtype": "float32",
                          "batch_size": 64, "seed": 0, "kv_cache_gb": 2.0, "max_model_len": None,
                          "gpu_memory_utilization": 0.9, "cache_dir": "~/.cache/mugrpo"}
    assert _parser().parse_args(["--model", "M", "--port", "1"]).engine == "vllm"  # the default engine


@pytest.mark.parametrize("argv", [["--model", "M"],  # --port is required
                                  ["--port", "0"],  # --model is required
                                  ["--model", "M", "--port", "0", "--engine", "tgi"],
                                  ["--model", "M", "--port", "zero"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_refused_before_anything_loads(port):
    args = _parser().parse_args(["--model", "/nonexistent", "--port", str(port), "--engine", "hf"])
    with pytest.raises(ConfigError, match=rf"--port {port}: a TCP port is 0..65535"):
        serve.run(args)
