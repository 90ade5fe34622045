"""A rollout service (``mugrpo serve --engine hf``, one subprocess for the module) as a client on the network
meets it: every route needs the key; weights load whole or not at all, only from --weights-dir, never
backwards; bad requests are 4xx naming the field or the limit and the service stays up; greedy and sampled
completions equal the in-process HF engine's, bit for bit. Also the old wire format's checks."""
import contextlib
import json
import os
import socket
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from mugrpo.config.rollout_sections import RolloutConfig
from mugrpo.models.loading import load_tokenizer
from mugrpo.rollout.engines import SamplingConfig, make_engine
from rollout_services import serving

KEY = "test-key-123"
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def svc(tiny_model_dir, weights_dir):
    with serving(tiny_model_dir, "--weights-dir", str(weights_dir), "--max-body-mb", "8", "--max-n", "64",
                 "--header-timeout-s", "2", api_key=KEY) as service:
        yield service


@pytest.fixture(scope="module")
def client(svc):
    with httpx.Client(base_url=svc.url, headers=svc.headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    return make_engine("hf", tiny_model_dir, tokenizer, RolloutConfig(engine="hf", dtype="float32", batch_size=4))


@contextlib.contextmanager
def _one_thread():
    """One thread, as the services run (tests/rollout_services.py): another thread count sums floats in another
    order, which changes log-probs in their last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _greedy(client) -> list:
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]]


def test_every_route_needs_the_key(svc, client):
    for method, path in [("GET", "/info"), ("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/load_weights"), ("GET", "/no-such-route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, svc.url + path, headers=headers, json={"prompt": [[1]]})
            assert r.status_code == 401 and "--api-key" in r.json()["error"], (method, path, headers)
    assert client.get("/health").status_code == 200


def test_models_and_info_name_the_model_but_no_path(client, tiny_model_dir):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "model" and models["data"][0]["max_model_len"] == 1024
    info = client.get("/info").json()
    assert (info["model"], info["engine"], info["dtype"], info["pending"]) == ("model", "hf", "float32", 0)
    assert not any(isinstance(v, str) and os.sep in v for v in info.values()), info


def test_completions_equal_the_in_process_hf_engine_bitwise(client, engine):
    # Greedy (temperature 0) ...
    r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "logprobs": 0})
    assert r.status_code == 200 and r.headers["x-mugrpo-weights-version"] == "0" and r.headers["x-mugrpo-boot-id"]
    with _one_thread():
        want = engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0, max_new_tokens=6))
    got = r.json()["choices"]
    assert [c["index"] for c in got] == [0, 1, 2]
    assert [(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"]) for c in got] == \
        [(w.token_ids, w.behavior_logprobs, w.finish_reason) for [w] in want]
    # ... and sampled, in the trainer's chunks (the second chunk's seeds), with per-prompt limits:
    # choices prompt-major, index = prompt * n + sample.
    sampling = SamplingConfig(n=2, temperature=1.0, top_p=0.9, max_new_tokens=7, seed=11)
    with _one_thread():
        want = engine.generate(PROMPTS, sampling, max_new_tokens=[7, 3, 5], first_chunk=1)
    r = client.post("/v1/completions", json={
        "model": "model", "prompt": PROMPTS, "n": 2, "max_tokens": 7, "temperature": 1.0, "top_p": 0.9, "top_k": -1,
        "seed": 11, "stop": [], "include_stop_str_in_output": True, "logprobs": 0, "return_token_ids": True,
        "skip_special_tokens": False, "mugrpo": {"first_chunk": 1, "batch_size": 4, "max_tokens": [7, 3, 5]}})
    assert r.status_code == 200, r.text
    got = r.json()["choices"]
    assert [c["index"] for c in got] == list(range(6))
    assert [(c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"]) for c in got] == \
        [(w.token_ids, w.behavior_logprobs, w.finish_reason) for group in want for w in group]


@pytest.mark.parametrize("body, says", [
    ({"prompt": [[1]], "n": 0}, "n: Input should be greater than or equal to 1"),
    ({"prompt": [[1]], "n": -1}, "n: Input should be greater than or equal to 1"),
    ({"prompt": [[1]], "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
    ({"prompt": [[1]], "beam": 3}, "beam: Extra inputs are not permitted"),
    ({"prompt": [[1, 100]]}, "prompt: prompt 0 has token id 100; the model's ids are 0..99"),
    ({"prompt": [[1]], "mugrpo": {"first_chunk": 1.5}}, "mugrpo.first_chunk: Input should be a valid integer"),
    ({"prompt": [[1], [2]], "mugrpo": {"max_tokens": [3]}}, "mugrpo.max_tokens: one limit per prompt (2)"),
    ({"prompt": [[1]], "model": "other"}, "model: this service serves 'model', not 'other'"),
    ({"prompt": [[1]], "n": 10**7}, "n: 10000000 samples per prompt is above this service's limit of 64 (--max-n)"),
    ({"prompt": [[1, 2]], "max_tokens": 1023},
     "max_tokens: prompt 0 has 2 tokens; with 1023 new tokens it passes the model's context of 1024 tokens"),
    ("[" * 100_000 + "]" * 100_000, "body: Invalid JSON: recursion limit exceeded"),
    ('{"prompt": [[1]], "temperature": Infinity}', "temperature: Input should be a finite number"),
])
def test_a_bad_request_is_a_4xx_naming_the_field_or_limit(client, body, says):
    r = client.post("/v1/completions", content=body if isinstance(body, str) else json.dumps(body))
    assert r.status_code in (400, 404) and says in r.json()["error"], r.text
    assert client.post("/v1/completions", json={"prompt": [[5]], "max_tokens": 2}).status_code == 200  # still up


def test_a_body_past_the_limit_is_a_413_naming_it(client):
    for headers in ({}, {"Transfer-Encoding": "chunked"}):  # announced, and streamed without a length
        body = b"x" * (100 * 2**20) if not headers else iter([b"x" * 2**20] * 100)
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 413 and "limit of 8 MB (--max-body-mb)" in r.json()["error"]
    assert client.get("/health").status_code == 200


def _weights(engine, **changes) -> dict:
    state = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    state.update(changes)
    return state


def test_refused_loads_change_nothing_and_a_good_one_changes_the_generations(client, engine, weights_dir, tmp_path):
    before, version = _greedy(client), client.get("/info").json()["weights_version"]
    norm = "model.layers.0.input_layernorm.weight"
    good = _weights(engine)
    missing = dict(good)
    missing.pop(norm)
    cases = {
        "shape.safetensors": (_weights(engine, **{norm: torch.ones(1)}), 400, f"tensor '{norm}' has shape [1]"),
        "missing.safetensors": (missing, 400, f"1 of the model's 20 parameters are missing, the first '{norm}'"),
        "unknown.safetensors": (_weights(engine, **{"lm_head.weight": good["model.embed_tokens.weight"]}), 400,
                                "tensor 'lm_head.weight' is not a parameter of the served model"),
        "int.safetensors": (_weights(engine, **{norm: torch.ones(64, dtype=torch.int64)}), 400,
                            f"tensor '{norm}' is int64, the service runs in float32"),
    }
    for name, (state, status, says) in cases.items():
        save_file(state, str(weights_dir / name))
        r = client.post("/load_weights", json={"path": name, "version": version + 1})
        assert r.status_code == status and says in r.json()["error"], (name, r.text)
    save_file(good, str(tmp_path / "outside.safetensors"))
    os.symlink(tmp_path / "outside.safetensors", weights_dir / "link.safetensors")
    for path in [str(tmp_path / "outside.safetensors"), "../outside.safetensors", "link.safetensors", "/etc/passwd"]:
        r = client.post("/load_weights", json={"path": path, "version": version + 1})
        assert r.status_code == 403 and "not inside the service's --weights-dir" in r.json()["error"], path
        assert str(tmp_path) not in r.text  # no path told back
    assert client.get("/info").json()["weights_version"] == version and _greedy(client) == before

    # A good version (one weight changed) loads, and the generations change with it ...
    changed = _weights(engine, **{"model.norm.weight": good["model.norm.weight"] * 3})
    save_file(changed, str(weights_dir / "v5.safetensors"))
    r = client.post("/load_weights", json={"path": "v5.safetensors", "version": 5})
    assert r.status_code == 200 and r.json()["weights_version"] == 5
    after = _greedy(client)
    assert after != before
    # ... and no version goes back, nor is loaded twice.
    for v in (5, 4):
        r = client.post("/load_weights", json={"path": "v5.safetensors", "version": v})
        assert r.status_code == 409 and f"version {v} is not above the service's current version 5" in r.text
    info = client.get("/info").json()
    assert (info["weights_version"], info["weights_file"]) == (5, "v5.safetensors") and _greedy(client) == after


def test_a_connection_that_sends_no_request_is_closed(svc):
    host, port = svc.url.removeprefix("http://").rsplit(":", 1)
    for sent in (b"", b"GET /info HTTP/1.1\r\nHost: x\r\n"):  # nothing, and headers never finished
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(sent)
            start = time.monotonic()
            assert conn.recv(100) == b""  # closed by the service (--header-timeout-s 2), not by the 30 s timeout
            assert time.monotonic() - start < 10


def test_a_body_that_never_arrives_is_a_408(svc):
    host, port = svc.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Length: 100\r\n\r\n{".encode())
        assert conn.recv(1000).startswith(b"HTTP/1.1 408")


def test_a_client_that_leaves_has_its_request_cancelled(svc, client):
    body = {"prompt": [[5, 6]], "n": 64, "max_tokens": 1000, "temperature": 1.0, "seed": 1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(svc.url + "/v1/completions", json=body, headers=svc.headers, timeout=1.0)
    deadline = time.monotonic() + 20
    while client.get("/info").json()["pending"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get("/info").json()["pending"] == 0  # ended at a decode step, not after 64 x 1000 tokens


def test_sigterm_stops_the_service_cleanly(svc):  # the module's last test: its service goes
    assert svc.stop() == 0
    err = "".join(svc.lines)
    assert "terminate called" not in err and "Traceback" not in err and "stopped" in err


@pytest.mark.unit
def test_the_default_weights_folder_is_shared_memory_where_it_exists(monkeypatch):
    import tempfile

    from mugrpo.rollout import service

    monkeypatch.setattr(service.os.path, "isdir", lambda p: p == "/dev/shm")
    assert service.default_weights_dir() == "/dev/shm/mugrpo-weights"
    monkeypatch.setattr(service.os.path, "isdir", lambda p: False)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/var/tmp")
    assert service.default_weights_dir() == "/var/tmp/mugrpo-weights"
