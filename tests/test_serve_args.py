"""``mugrpo serve``'s arguments (mugrpo.serve): what they parse to, and the checks made before any model
loads."""
import argparse

import pytest

from mugrpo.serve import start as serve
from mugrpo.errors import ConfigError

pytestmark = pytest.mark.unit


def _parser():
    p = argparse.ArgumentParser(prog="mugrpo serve")
    serve.add_arguments(p)
    return p


def test_the_arguments_and_their_defaults():
    args = _parser().parse_args(["--model", "M", "--port", "0", "--engine", "hf"])
    assert vars(args) == {"model": "M", "port": 0, "host": "127.0.0.1", "engine": "hf", "dtype": "auto",
                          "api_key": None, "weights_dir": None, "batch_size": 64, "seed": 0, "max_model_len": None,
                          "max_num_seqs": 128, "kv_cache_gb": "auto", "gpu_memory_utilization": 0.9,
                          "max_body_mb": 32.0, "max_n": 256, "max_seqs": 4096, "header_timeout_s": 30.0,
                          "served_model_name": None,
                          "cache_dir": "~/.cache/mugrpo"}
    assert _parser().parse_args(["--model", "M", "--port", "1"]).engine == "vllm"  # the default engine


@pytest.mark.parametrize("argv", [["--model", "M"],  # --port is required
                                  ["--port", "0"],  # --model is required
                                  ["--model", "M", "--port", "0", "--engine", "tgi"],
                                  ["--model", "M", "--port", "0", "--dtype", "int8"],
                                  ["--model", "M", "--port", "zero"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2


@pytest.mark.parametrize("extra, says", [
    (["--port", "-1"], "--port -1: a TCP port is 0..65535"),
    (["--port", "65536"], "--port 65536: a TCP port is 0..65535"),
    (["--port", "0", "--max-n", "0"], "--max-n 0: must be > 0"),
    (["--port", "0", "--max-body-mb", "-1"], "--max-body-mb -1.0: must be > 0"),
    (["--port", "0", "--kv-cache-gb", "lots"], "--kv-cache-gb lots: a size in GB > 0, or auto"),
    (["--port", "0", "--api-key", " "], "--api-key is empty"),
    (["--port", "0", "--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond this machine"),
])
def test_bad_values_are_refused_before_anything_loads(extra, says, monkeypatch):
    monkeypatch.delenv("MUGRPO_API_KEY", raising=False)
    args = _parser().parse_args(["--model", "/nonexistent", "--engine", "hf", *extra])
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        serve.run(args)


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.setenv("MUGRPO_API_KEY", "from-env")
    assert serve.check_start(_parser().parse_args(["--model", "M", "--engine", "hf", "--port", "0"])) == "from-env"
    with_flag = _parser().parse_args(["--model", "M", "--engine", "hf", "--port", "0", "--api-key", "flag"])
    assert serve.check_start(with_flag) == "flag"
    monkeypatch.delenv("MUGRPO_API_KEY")
    assert serve.check_start(_parser().parse_args(["--model", "M", "--engine", "hf", "--port", "0"])) is None
