"""The remote engine against real ``mugrpo serve --engine hf`` services (subprocesses, the tiny model):
what it samples equals the in-process HF engine's, with one service or several, from several threads at
once, and after a service dies, hangs, freezes or restarts mid-call; chunks go to the next free service;
what it refuses (another model, tokenizer or dtype, weights it did not push, malformed answers, a missing
key) names the service or the key. Unit tests of its parts (the weights files, the answers' checks, the
reader-writer lock) need no service."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from rollout_services import service_env, serving, start
from transformers import AutoModelForCausalLM

from mugrpo.config import load_config
from mugrpo.errors import ConfigError
from mugrpo.models.loading import load_tokenizer
from mugrpo.models.tiny import build_tiny_model
from mugrpo.rollout.engines import SamplingConfig, make_engine
from mugrpo.rollout.engines.remote import RemoteUnavailable, ServiceRefused, WeightsDirError
from mugrpo.rollout.engines.remote.dispatch import DOWN, LIVE
from mugrpo.rollout.engines.remote.engine import ReadWriteLock
from mugrpo.rollout.engines.remote.weights import WeightsFolder, host_name, remove_dead_trainers_files
from mugrpo.rollout.engines.remote.wire import completions_from_answer

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [7, 7], [6]]
SAMPLING = SamplingConfig(n=2, max_new_tokens=6, seed=5)
LIMITS = [6, 3, 6, 2, 6]


def _info(url, key=None):
    return httpx.get(url + "/info", headers={"Authorization": f"Bearer {key}"} if key else {}).json()


@pytest.fixture(scope="module")
def svc(tiny_model_dir):
    with serving(tiny_model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def svc2(tiny_model_dir):
    with serving(tiny_model_dir) as s:
        yield s


def _moved(model_dir, scale, seed=0):
    """The tiny model's weights moved off the service's own (so a service that skipped a load would differ)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    return _moved(tiny_model_dir, 0.05)


def _rollout(urls, *extra):
    return load_config(None, None, ["rollout.engine=remote", f"rollout.remote.urls=[{','.join(urls)}]",
                                    "rollout.dtype=float32", "rollout.batch_size=4", *extra]).rollout


def _remote(model_dir, urls, *extra, tokenizer=None):
    return make_engine("remote", model_dir, tokenizer or load_tokenizer(model_dir), _rollout(urls, *extra))


def _in_process(model_dir, weights, prompts, sampling, **kwargs):
    hf = make_engine("hf", model_dir, load_tokenizer(model_dir), _rollout(["http://x"]))
    hf.load_weights(weights)
    # One thread, as the services run (tests/rollout_services.py): another thread count sums floats in
    # another order, which can flip a near-tie in sampling (this process has OMP_NUM_THREADS's count).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf.generate(prompts, sampling, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, weights):
    """What the in-process HF engine samples (batch_size 4, n 2: chunks of 2 prompts, 3 chunks)."""
    return (_in_process(tiny_model_dir, weights, PROMPTS, SAMPLING),
            _in_process(tiny_model_dir, weights, PROMPTS, SAMPLING, max_new_tokens=LIMITS))


def _failover_lines(text, url):
    return [line for line in text.splitlines() if line.startswith(f"[mugrpo] rollout service {url} left out")]


# -- parts, no service --------------------------------------------------------------------------------

@pytest.mark.unit
def test_choices_are_placed_by_index_and_malformed_ones_refused():
    def choice(index, ids, finish="stop"):
        return {"index": index, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                "finish_reason": finish}

    # 2 prompts x n=2, sent out of order: choice i * n + j is prompt i's j-th.
    answer = {"choices": [choice(3, [4]), choice(0, [1]), choice(2, [3], "length"), choice(1, [2])]}
    groups = completions_from_answer(answer, 2, 2)
    assert [[c.token_ids for c in g] for g in groups] == [[[1], [2]], [[3], [4]]]
    assert groups[1][0].finish_reason == "length"
    with pytest.raises(ValueError, match="repeated"):
        completions_from_answer({"choices": [choice(0, [1]), choice(0, [2])]}, 1, 2)
    bad = choice(0, [1, 2])
    bad["logprobs"]["token_logprobs"] = [-0.5]
    with pytest.raises(ValueError, match="equal length"):
        completions_from_answer({"choices": [bad]}, 1, 1)
    with pytest.raises(ValueError, match="finish_reason 'abort'"):
        completions_from_answer({"choices": [choice(0, [1], "abort")]}, 1, 1)


@pytest.mark.unit
def test_a_waiting_weight_load_holds_new_calls_until_the_ones_in_flight_end():
    lock, order = ReadWriteLock(), []
    reading = threading.Event()

    def reader(name, hold_s):
        with lock.reading():
            order.append(f"{name} in")
            reading.set()
            time.sleep(hold_s)
            order.append(f"{name} out")

    first = threading.Thread(target=reader, args=("r1", 0.3))
    first.start()
    reading.wait()
    writer_waits = threading.Event()

    def writer():
        writer_waits.set()
        with lock.writing():
            order.append("w")

    w = threading.Thread(target=writer)
    w.start()
    writer_waits.wait()
    time.sleep(0.05)  # the writer is waiting for r1; a new reader must now queue behind it
    second = threading.Thread(target=reader, args=("r2", 0))
    second.start()
    for t in (first, w, second):
        t.join()
    assert order == ["r1 in", "r1 out", "w", "r2 in", "r2 out"]


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # gone (reaped); pids are not reused this quickly


@pytest.mark.unit
def test_weights_files_of_dead_trainers_on_this_host_are_removed_at_start(tmp_path):
    token, dead = "0123456789ab", _dead_pid()
    gone = [tmp_path / f"mugrpo-{host_name()}-{dead}-{token}-v000003.safetensors",
            tmp_path / f".mugrpo-{host_name()}-{dead}-{token}-v000004.safetensors.tmp-{dead}"]
    kept = [tmp_path / f"mugrpo-{host_name()}-{os.getpid()}-{token}-v000003.safetensors",  # alive
            tmp_path / f"mugrpo-other-host-{dead}-{token}-v000003.safetensors",  # another machine's trainer
            tmp_path / "model.safetensors"]
    for path in gone + kept:
        path.write_bytes(b"x")
    assert sorted(remove_dead_trainers_files(tmp_path)) == sorted(gone)
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def _read_only_dir(tmp_path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return folder
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("needs a folder root cannot write (sysfs)")
    return Path("/sys/kernel/mugrpo-weights")  # sysfs takes no new file, not even from root


@pytest.mark.unit
def test_a_weights_folder_the_trainer_cannot_write_names_the_key(tmp_path):
    with pytest.raises(WeightsDirError, match=r"rollout\.remote\.weights_dir=.*cannot write there.*--resume RUN_DIR"):
        WeightsFolder(_read_only_dir(tmp_path)).prepare()
    folder = WeightsFolder(tmp_path / "w")
    folder.prepare()
    (tmp_path / "w").rmdir()
    (tmp_path / "w").write_text("now a file, not a folder")  # the folder went away mid-run
    with pytest.raises(WeightsDirError, match=r"writing weights version 2 failed.*mugrpo train --resume RUN_DIR"):
        folder.write([("w", torch.ones(2))], "float32", 2)


@pytest.mark.unit
def test_a_trainers_weights_files_are_removed_when_it_exits(tmp_path):
    code = ("import sys, torch; from mugrpo.rollout.engines.remote.weights import WeightsFolder\n"
            f"w = WeightsFolder({str(tmp_path)!r}); w.prepare()\n"
            "w.write([('w', torch.ones(2))], 'float32', 1); w.write([('w', torch.ones(2))], 'float32', 2)\n"
            "print(len(list(w.folder.glob('*.safetensors'))))\n"
            "sys.exit(3)  # no close(): the interpreter's exit removes them")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=service_env())
    assert out.returncode == 3 and out.stdout.strip() == "2", out.stderr
    assert list(tmp_path.iterdir()) == []


# -- against services ----------------------------------------------------------------------------------

def test_one_or_two_services_sample_exactly_what_the_hf_engine_samples(tiny_model_dir, svc, svc2, weights, expected):
    for urls in ([svc.url], [svc.url, svc2.url]):
        engine = _remote(tiny_model_dir, urls)
        start_version = engine.version  # the highest version the services held (a version never goes back)
        engine.load_weights(weights)
        seen = []
        assert engine.generate(PROMPTS, SAMPLING, progress=seen.append) == expected[0]
        assert sum(seen) == 10  # every sequence reported once
        assert engine.generate(PROMPTS, SAMPLING, max_new_tokens=LIMITS) == expected[1]
        first = engine.weights_path
        engine.load_weights(weights)  # the next version: the file of the first is gone, the services say 2
        assert not os.path.exists(first) and engine.version == start_version + 2
        for url in urls:
            info = _info(url)
            assert (info["weights_version"], info["weights_file"]) == (engine.version, Path(engine.weights_path).name)
        engine.close()
        assert not os.path.exists(engine.weights_path or first)


def test_a_sync_from_another_thread_waits_for_the_call_in_flight(tiny_model_dir, svc, weights, expected):
    engine = _remote(tiny_model_dir, [svc.url])
    engine.load_weights(weights)
    v = engine.version
    other = [(n, t + 1.0) for n, t in weights]  # weights that would change every sample
    loader = threading.Thread(target=engine.load_weights, args=(other,))

    def progress(k):
        if not loader.is_alive() and engine.version == v:
            loader.start()  # a sync asked for while the call runs (e.g. the trainer, beside a generating thread)

    assert engine.generate(PROMPTS, SAMPLING, progress=progress) == expected[0]  # all from version v
    assert engine.generate_version == v
    loader.join()
    assert engine.version == v + 1 and _info(svc.url)["weights_version"] == v + 1
    engine.close()


def test_calls_from_several_threads_each_get_the_answers_of_one_weights_version(tiny_model_dir, svc, svc2, weights,
                                                                                 expected):
    other = _moved(tiny_model_dir, 0.05, seed=1)
    expected_other = _in_process(tiny_model_dir, other, PROMPTS, SAMPLING)
    assert expected_other != expected[0]
    engine = _remote(tiny_model_dir, [svc.url, svc2.url])
    engine.load_weights(weights)
    results, first_done, loaded = {}, threading.Event(), threading.Event()

    def caller(i):
        for call in range(3):
            if call == 2:
                loaded.wait()  # the last call of each thread comes after the new version
            results[i, call] = engine.generate(PROMPTS, SAMPLING)
            first_done.set()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    first_done.wait()
    engine.load_weights(other)  # while other calls are in flight: it waits for them, new ones wait for it
    loaded.set()
    for t in threads:
        t.join()
    assert len(results) == 12
    assert all(r in (expected[0], expected_other) for r in results.values())  # never a mix of two versions
    assert all(results[i, 2] == expected_other for i in range(4))
    assert sum(r == expected[0] for r in results.values()) >= 1
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
    v = engine.version
    answer = httpx.post(svc2.url + "/load_weights", json={"path": Path(engine.weights_path).name, "version": v + 6})
    assert answer.status_code == 200, answer.text
    refused = rf"{svc2.url} holds weights version {v + 6}.*not this trainer's version {v}"
    with pytest.raises(ServiceRefused, match=refused):
        engine.generate(PROMPTS, SAMPLING)
    engine.close()


def test_the_api_key_goes_from_the_config_or_the_environment_to_the_service(tiny_model_dir, weights, expected,
                                                                            monkeypatch):
    monkeypatch.delenv("MUGRPO_API_KEY", raising=False)
    with serving(tiny_model_dir, "--api-key", "s3cret") as keyed:
        assert httpx.get(keyed.url + "/info").status_code == 401
        with pytest.raises(ConfigError, match=rf"rollout\.remote\.api_key: .*{keyed.url}.*401"):
            _remote(tiny_model_dir, [keyed.url])
        with pytest.raises(ConfigError, match=r"rollout\.remote\.api_key"):
            _remote(tiny_model_dir, [keyed.url], "rollout.remote.api_key=wrong")
        engine = _remote(tiny_model_dir, [keyed.url], "rollout.remote.api_key=s3cret")
        engine.load_weights(weights)
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]
        engine.close()
        monkeypatch.setenv("MUGRPO_API_KEY", "s3cret")
        engine = _remote(tiny_model_dir, [keyed.url])
        engine.load_weights(weights)
        assert engine.generate(PROMPTS, SAMPLING, max_new_tokens=LIMITS) == expected[1]
        engine.close()


def test_a_slow_service_takes_fewer_chunks(tiny_model_dir, svc, svc2, weights):
    # 16 prompts, n 2, batch_size 4: 8 chunks of 2 prompts. svc is stopped (SIGSTOP, well inside timeout_s)
    # before the call: it holds the 2 chunks it was given first (2 in flight per HF service); svc2 takes the
    # other 6 as it frees. The samples are still those of one in-process call.
    prompts = [[5 + i % 7, 6 + i % 5, 7] for i in range(16)]
    engine = _remote(tiny_model_dir, [svc.url, svc2.url], "rollout.remote.timeout_s=60")
    engine.load_weights(weights)
    box = {}
    svc.proc.send_signal(signal.SIGSTOP)
    try:
        caller = threading.Thread(target=lambda: box.update(out=engine.generate(prompts, SAMPLING)))
        caller.start()
        deadline = time.monotonic() + 120
        while engine.services[1].num_chunks < 6 and time.monotonic() < deadline and caller.is_alive():
            time.sleep(0.1)
    finally:
        svc.proc.send_signal(signal.SIGCONT)
    caller.join()
    assert box["out"] == _in_process(tiny_model_dir, weights, prompts, SAMPLING)
    host = [url.split("//")[1] for url in (svc.url, svc2.url)]
    metrics = engine.metrics()
    assert (metrics[f"perf/remote_chunks/{host[0]}"], metrics[f"perf/remote_chunks/{host[1]}"]) == (2.0, 6.0)
    assert metrics["perf/remote_failovers"] == 0.0
    engine.close()


@pytest.mark.parametrize("fault", ["MUGRPO_DIE_AT", pytest.param("MUGRPO_FREEZE_AT", marks=pytest.mark.slow),
                                   "MUGRPO_HANG_AT"])
def test_a_service_that_dies_or_hangs_mid_call_loses_its_chunks_to_another_once(tiny_model_dir, svc, weights,
                                                                                 expected, fault, capsys):
    # DIE: killed; FREEZE: SIGSTOP, /info silent; HANG: the engine stuck on the request, /info still answering
    # (caught by its since_progress_s passing stall_timeout_s).
    failing = start(tiny_model_dir, env=service_env(**{fault: "serve_generate:1"}))
    try:
        engine = _remote(tiny_model_dir, [failing.url, svc.url], "rollout.remote.timeout_s=2",
                         "rollout.remote.stall_timeout_s=3")
        engine.load_weights(weights)
        capsys.readouterr()
        # The failing service takes chunks 0 and 2 (prompts 0..1 and 4) and dies (or freezes, or sticks) on
        # them; the other generates them too, with the chunks' own seeds: the same completions as one call.
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]
        assert (failing.proc.poll() == -9) if fault == "MUGRPO_DIE_AT" else failing.proc.poll() is None
        if fault == "MUGRPO_HANG_AT":
            info = _info(failing.url)
            assert info["pending"] >= 1 and info["since_progress_s"] > 3
            assert "made no progress" in engine.services[0].failure
        # Later calls go to the live one alone, at once: the failed one is asked /info in the background only.
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]
        assert [s.state for s in engine.services] == [DOWN, LIVE]  # asked /info in the background, still out
        assert engine.services[0].num_failures == 1 and engine.services[0].num_chunks == 0
        lines = _failover_lines(capsys.readouterr().err, failing.url)
        assert len(lines) == 1 and "prompts 0..1, 4..4" in lines[0] and f"go to {svc.url}" in lines[0], lines
        engine.close()
    finally:
        failing.kill()


@pytest.mark.slow  # ~16 s
def test_a_restarted_service_gets_the_current_weights_before_use(tiny_model_dir, weights, expected):
    first = start(tiny_model_dir)
    port = first.url.rsplit(":", 1)[1]
    engine = _remote(tiny_model_dir, [first.url])
    engine.load_weights(weights)
    first.kill()
    again = start(tiny_model_dir, "--port", port)
    try:
        assert engine.generate(PROMPTS, SAMPLING) == expected[0]  # not the service's own start-up weights
        assert _info(again.url)["weights_version"] == engine.version
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


def _fake_service(info, completions: bytes, headers: dict):
    """A stand-in for a broken service: a real service's /info, a canned /v1/completions answer."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, data, extra):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._send(json.dumps(info).encode(), {})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(completions, headers)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_malformed_or_truncated_answers_are_refused_naming_the_url(tiny_model_dir, svc):
    info = _info(svc.url)
    ours = {"x-mugrpo-weights-version": str(info["weights_version"]), "x-mugrpo-boot-id": info["boot_id"]}
    wrong = {"choices": [{"index": i, "token_ids": [3, 4], "logprobs": {"token_logprobs": [-1.0]},
                          "finish_reason": "length"} for i in range(4)]}
    cases = [(json.dumps(wrong).encode(), ours, r"answered /v1/completions with a malformed result.*equal length"),
             (b'{"choices": [{"index": 0, "token_ids": [3, 4], "logp', ours,
              r"answered /v1/completions with malformed JSON"),
             (json.dumps(wrong).encode(), {}, r"answered without the x-mugrpo-boot-id")]
    for body, headers, message in cases:
        server, url = _fake_service(info, body, headers)
        engine = _remote(tiny_model_dir, [url])
        try:
            with pytest.raises(ServiceRefused, match=rf"{url} {message}"):
                engine.generate(PROMPTS[:2], SAMPLING)
        finally:
            engine.close()
            server.shutdown()
