"""``mugrpo serve``'s start: a port in use or out of range exits 2 naming ``--port``, and a host beyond this
machine without a key exits 2 naming ``--api-key``, before any model loads; the dtype resolves by the
trainer's rule; the KV cache is sized for the sequences the service runs at once."""
import socket

import pytest

from mugrpo.cli import main
from mugrpo.hardware import detect, resolve
from mugrpo.serve.start import kv_bytes_per_token, kv_cache_bytes, resolve_dtype

pytestmark = pytest.mark.unit


def test_a_port_in_use_exits_2_naming_the_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model folder does not exist: the port is checked first, so the error is the port's.
        assert main(["serve", "--engine", "hf", "--model", "/nonexistent", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "already in use" in err and "--port 0" in err


def test_a_port_out_of_range_exits_2(capsys):
    assert main(["serve", "--engine", "hf", "--model", "/nonexistent", "--port", "70000"]) == 2
    assert "--port 70000: a TCP port is 0..65535" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_a_host_beyond_loopback_without_a_key_exits_2_naming_api_key(host, capsys, monkeypatch):
    monkeypatch.delenv("MUGRPO_API_KEY", raising=False)
    assert main(["serve", "--engine", "hf", "--model", "/nonexistent", "--port", "0", "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"--host {host}" in err and "--api-key KEY (or MUGRPO_API_KEY)" in err


def test_a_key_from_the_environment_counts(capsys, monkeypatch):
    monkeypatch.setenv("MUGRPO_API_KEY", "k")
    # Past the host check: the next problem is the model folder's.
    assert main(["serve", "--engine", "hf", "--model", "/nonexistent", "--port", "0", "--host", "0.0.0.0"]) == 2
    assert "--api-key" not in capsys.readouterr().err


def test_auto_dtype_is_the_trainers_rule():
    assert resolve_dtype("auto") == resolve("auto", "auto", "hf", detect()).engine_dtype
    assert resolve_dtype("bfloat16") == "bfloat16"


def test_the_kv_cache_holds_the_sequences_run_at_once_within_the_cap():
    class Config:  # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, head_dim = 30, 9, 3, 576, 64

    per_token = kv_bytes_per_token(Config, "bfloat16")
    assert per_token == 2 * 30 * 3 * 64 * 2 == 23040  # K and V, every layer, 2 bytes each
    assert kv_cache_bytes(per_token, 8, 512, 2**30) == 8 * 512 * 23040  # 90 MB: within the cap
    assert kv_cache_bytes(per_token, 128, 4096, 2**30) == 2**30  # capped
    assert kv_cache_bytes(per_token, 128, 65536, 2**30) == 65536 * 23040  # never below one whole sequence


def test_the_vllm_engine_without_vllm_exits_2_naming_the_way_out(capsys):
    pytest.importorskip("fastapi")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    assert main(["serve", "--engine", "vllm", "--model", "/nonexistent", "--port", "0"]) == 2
    assert "--engine vllm needs vLLM" in capsys.readouterr().err
