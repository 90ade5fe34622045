"""The remote engine against real ``mugrpo serve --engine hf`` services (subprocesses, the tiny model):
what it samples equals the in-process HF engine's, with one service or several, and after a service
dies, hangs or restarts mid-call; what it refuses (another model, tokenizer or dtype, weights it did not
push, malformed answers) names the service."""
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from rollout_services import service_env, serving, start
from transformers import AutoModelForCausalLM

from mugrpo.config import load_config
from mugrpo.errors import ConfigError
from mugrpo.models.loading import load_tokenizer
from mugrpo.models.tiny import build_tiny_model
from mugrpo.rollout.engines import SamplingConfig, make_engine
from mugrpo.rollout.engines.remote import RemoteUnavailable, ServiceRefused, split_parts
from mugrpo.rollout.service import ServiceState, make_server

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [7, 7], [6]]
SAMPLING = SamplingConfig(n=2, max_new_tokens=6, seed=5)
LIMITS = [6, 3, 6, 2, 6]


@pytest.fixture(scope="module")
def svc(tiny_model_dir):
    with serving(tiny_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def svc2(tiny_model_dir):
    with serving(tiny_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    """The tiny model's weights moved off the service's own (so a service that skipped a load would differ)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def _rollout(urls, *extra):
    return load_config(None, None, ["rollout.engine=remote", f"rollout.remote.urls=[{','.join(urls)}]",
                                    "rollout.dtype=float32", "rollout.batch_size=4", *extra]).rollout


def _remote(model_dir, urls, *extra, tokenizer=None):
    return make_engine("remote", model_dir, tokenizer or load_tokenizer(model_dir), _rollout(urls, *extra))


@pytest.fixture(scope="module")
def expected(tiny_model_dir, weights):
    """What the in-process HF engine samples (batch_size 4, n 2: chunks of 2 prompts, 3 chunks)."""
    hf = make_engine("hf", tiny_model_dir, load_tokenizer(tiny_model_dir), _rollout(["http://x"]))
    hf.load_weights(weights)
    # One thread, as the services run (tests/rollout_services.py): another thread count sums floats in
    # another order, which can flip a near-tie in sampling (this process has OMP_NUM_THREADS's count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf.generate(PROMPTS, SAMPLING), hf.generate(PROMPTS, SAMPLING, max_new_tokens=LIMITS)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.unit
def test_parts_are_contiguous_and_cut_at_chunk_boundaries():
    # 10 prompts in chunks of 2 = 5 chunks over 2 services: 3 + 2 chunks.
    assert split_parts(10, 2, 2) == [(0, 6), (6, 10)]
    # 5 prompts, chunks of 2 = 3 chunks (the last one short) over 3 services: one chunk each.
    assert split_parts(5, 2, 3) == [(0, 2), (2, 4), (4, 5)]
    # more services than chunks: the extra ones get nothing.
    assert split_parts(3, 4, 2) == [(0, 3)]


def test_one_or_two_services_sample_exactly_what_the_hf_engine_samples(tiny_model_dir, svc, svc2, weights, expected):
    for urls in ([svc.url], [svc.url, svc2.url]):
        engine = _remote(tiny_model_dir, urls)
        engine.load_weights(weights)
        seen = []
        assert engine.generate(PROMPTS, SAMPLING, progress=seen.append) == expected[0]
        assert sum(seen) == 10  # every sequence reported once
        assert engine.generate(PROMPTS, SAMPLING, max_new_tokens=LIMITS) == expected[1]
        first = engine.weights_path
        engine.load_weights(weights)  # version 2: the file of version 1 is gone, the services say 2
        assert not __import__("os").path.exists(first)
        for url in urls:
            info = json.loads(urllib.request.urlopen(url + "/info").read())
            assert (info["weights_version"], info["weights_path"]) == (2, engine.weights_path)
        engine.close()


def test_a_sync_from_another_thread_waits_for_the_call_in_flight(tiny_model_dir, svc, weights, expected):
    engine = _remote(tiny_model_dir, [svc.url])
    engine.load_weights(weights)
    other = [(n, t + 1.0) for n, t in weights]  # weights that would change every sample
    loader = threading.Thread(target=engine.load_weights, args=(other,))

    def progress(k):
        if not loader.is_alive() and engine.version == 1:
            loader.start()  # a sync asked for while the call runs (e.g. the trainer, beside a generating thread)

    assert engine.generate(PROMPTS, SAMPLING, progress=progress) == expected[0]  # all from version 1
    assert engine.generate_version == 1
    loader.join()
    assert engine.version == 2 and json.loads(urllib.request.urlopen(svc.url + "/info").read())["weights_version"] == 2
    engine.close()


def test_unreachable_url_is_a_config_error_naming_the_key(tiny_model_dir):
    url = "http://127.0.0.1:9"  # the discard port: nothing listens there
    with pytest.raises(ConfigError, match=r"rollout\.remote\.urls.*127\.0\.0\.1:9"):
        _remote(tiny_model_dir, [url])


def test_another_model_tokenizer_or_dtype_is_refused_naming_the_url(tmp_path, tiny_model_dir, svc):
    other = str(build_tiny_model(tmp_path / "wider", hidden=32))
    with pytest.raises(ServiceRefused, match=rf"{svc.url} serves another model.*{other}"):
        _remote(other, [svc.url])
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    with pytest.raises(ServiceRefused, match=rf"{svc.url} has another tokenizer"):
        _remote(tiny_model_dir, [svc.url], tokenizer=tokenizer)
    with pytest.raises(ServiceRefused, match=r"runs in float32.*--dtype bfloat16"):
        _remote(tiny_model_dir, [svc.url], "rollout.dtype=bfloat16")


def test_weights_another_trainer_pushed_are_refused(tiny_model_dir, svc2, weights):
    engine = _remote(tiny_model_dir, [svc2.url])
    engine.load_weights(weights)
    body = json.dumps({"path": engine.weights_path, "version": 7}).encode()
    urllib.request.urlopen(urllib.request.Request(svc2.url + "/load_weights", data=body))
    with pytest.raises(ServiceRefused, match=rf"{svc2.url} holds weights version 7.*not this trainer's version 1"):
        engine.generate(PROMPTS, SAMPLING)
    engine.close()


@pytest.mark.parametrize("fault", ["MUGRPO_DIE_AT", "MUGRPO_FREEZE_AT", "MUGRPO_HANG_AT"])
def test_a_service_that_dies_or_hangs_mid_call_loses_its_part_to_another(tiny_model_dir, svc, weights, expected,
                                                                          fault):
    # DIE: killed; FREEZE: SIGSTOP, /info silent; HANG: the engine stuck on the request, /info still answering
    # (caught by its since_progress_s passing stall_timeout_s).
    failing = start(tiny_model_dir, env=service_env(**{fault: "serve_generate:1"}))
    try:
        engine = _remote(tiny_model_dir, [failing.url, svc.url], "rollout.remote.timeout_s=2",
                         "rollout.remote.stall_timeout_s=3")
        engine.load_weights(weights)
        # The failing service takes prompts 0..3 and dies (or freezes, or sticks) on them; the other
        # generates them after its own part, with the part's own seeds: the same completions as one call.
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]
        assert (failing.proc.poll() == -9) if fault == "MUGRPO_DIE_AT" else failing.proc.poll() is None
        if fault == "MUGRPO_HANG_AT":
            info = json.loads(urllib.request.urlopen(failing.url + "/info").read())
            assert info["pending"] == 1 and info["since_progress_s"] > 3
            assert [s.alive for s in engine.services] == [False, True]
            assert "made no progress" in engine.services[0].failure
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]  # the next call goes to the live one alone
        assert not engine.services[0].alive  # a stuck service stays out (asked again before the call)
        engine.close()
    finally:
        failing.kill()


def test_a_restarted_service_gets_the_current_weights_before_use(tiny_model_dir, weights, expected):
    first = start(tiny_model_dir)
    port = first.url.rsplit(":", 1)[1]
    engine = _remote(tiny_model_dir, [first.url])
    engine.load_weights(weights)
    first.kill()
    again = start(tiny_model_dir, "--port", port)
    try:
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]  # not the service's own start-up weights
        assert any("loaded weights version 1" in line for line in again.lines)
        engine.close()
    finally:
        again.kill()


def test_no_service_left_names_the_urls_and_the_resume_command(tiny_model_dir, weights):
    failing = start(tiny_model_dir, env=service_env(MUGRPO_DIE_AT="serve_generate:1"))
    try:
        engine = _remote(tiny_model_dir, [failing.url])
        engine.load_weights(weights)
        with pytest.raises(RemoteUnavailable, match=rf"no rollout service is left: {failing.url}.*mugrpo train "
                                                    r"--resume RUN_DIR"):
            engine.generate(PROMPTS, SAMPLING)
        engine.close()
    finally:
        failing.kill()


class _WrongLengths:
    """A broken engine: one log-prob short for every completion."""

    def generate(self, prompts, sampling, max_new_tokens=None, **kwargs):
        from mugrpo.rollout.engines.base import Completion

        return [[Completion([3, 4], [-1.0], "length")] * sampling.n for _ in prompts]


def _in_thread(server):
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def test_malformed_or_truncated_answers_are_refused_naming_the_url(tiny_model_dir, svc):
    info = json.loads(urllib.request.urlopen(svc.url + "/info").read())
    # A service whose engine answers with token ids and log-probs of different lengths.
    server = make_server(ServiceState(_WrongLengths(), {**info, "engine": "broken"}, vocab_size=100), "127.0.0.1", 0)
    url = _in_thread(server)
    with pytest.raises(ServiceRefused, match=rf"{url} answered /generate with a malformed result.*equal length"):
        _remote(tiny_model_dir, [url]).generate(PROMPTS, SAMPLING)
    server.shutdown()

    class Truncated(BaseHTTPRequestHandler):  # complete HTTP answers, cut-off JSON
        def log_message(self, *args):
            pass

        def _send(self, data):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._send(json.dumps(info).encode())

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(b'{"completions": [[{"token_ids": [3, 4], "logp')

    server = ThreadingHTTPServer(("127.0.0.1", 0), Truncated)
    url = _in_thread(server)
    with pytest.raises(ServiceRefused, match=rf"{url} answered /generate with malformed JSON"):
        _remote(tiny_model_dir, [url]).generate(PROMPTS, SAMPLING)
    server.shutdown()
