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
