"""Independent trajectories end to end against one ``mugrpo serve --engine hf`` service (a subprocess, the tiny
model): two runs give the same trajectories although random step latencies make them finish in different
orders, and the same as the in-process HF engine answering one call at a time (what an HF service does);
tools and generation overlap; ``env.lockstep=true`` gives the lock-step loop's trajectories. A training run
through the service with independent trajectories equals the in-process one, stage for stage."""
import random
import threading
import time

import pytest
import torch
from rollout_services import serving

from mugrpo.config import load_config
from mugrpo.models.loading import load_tokenizer
from mugrpo.observability.loggers import read_metrics
from mugrpo.rollout.engines import ENGINES, SamplingConfig, make_engine
from mugrpo.rollout.engines.remote import RemoteEngine
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, loop_metrics, run_trajectories

# The random tiny model samples characters almost uniformly: one-character stop strings end most turns early.
STOPS = ("=", "p", "&", "g", "3")
G = 3


class Slow(Environment):
    """'no' twice, then done (reward = turns); each step sleeps a random 0..60 ms from an unseeded stream."""

    stop = STOPS
    max_turns = 3

    def __init__(self, ends: list):
        self.n, self.ends = 0, ends

    def step(self, action):
        time.sleep(random.uniform(0.0, 0.06))
        self.n += 1
        self.ends.append(self)
        if self.n == 3:
            return StepResult([], reward=float(self.n), done=True)
        return StepResult([{"role": "user", "content": "no" * self.n}])


class OneAtATime:
    """An in-process engine that answers concurrent callers one call at a time (as an HF service does)."""

    concurrent = True

    def __init__(self, engine):
        self.engine, self.lock = engine, threading.Lock()

    def generate(self, *args, **kwargs):
        with self.lock:
            return self.engine.generate(*args, **kwargs)


def _rollout(url):
    return load_config(None, None, ["rollout.engine=remote", f"rollout.remote.urls=[{url}]", "rollout.dtype=float32",
                                    "rollout.batch_size=4"]).rollout


def _roll(engine, tok, lockstep=False):
    ends: list = []
    envs = [Slow(ends) for _ in range(2 * G)]
    prompts = [tok("u:Calculate 5 - 3.\na:")["input_ids"], tok("u:Hi\na:")["input_ids"]]
    ctx = LoopContext(engine, tok, LoopLimits(max_turns=3, max_response_tokens=60, lockstep=lockstep),
                      render_env_turn=lambda m, eos: tok(f"\nu:{m[0]['content']}\na:")["input_ids"],
                      eos=[tok.eos_token_id])
    trajs = run_trajectories(ctx, prompts, envs, SamplingConfig(max_new_tokens=12, seed=9))
    order = tuple(envs.index(env) for env in ends)
    return [(t.response_ids, t.behavior_logprobs, t.turns, t.end_reason, t.env_reward) for t in trajs], order, trajs


@pytest.fixture(scope="module")
def svc(tiny_model_dir):
    with serving(tiny_model_dir) as s:
        yield s


def test_independent_trajectories_through_an_hf_service_are_reproducible_and_bitwise(tiny_model_dir, svc):
    tok = load_tokenizer(tiny_model_dir)
    remote = make_engine("remote", tiny_model_dir, tok, _rollout(svc.url))
    if not hasattr(remote, "concurrent"):
        # Until the remote engine sends calls concurrently it takes them in turn under its lock: thread-safe.
        remote.concurrent = True
    runs = [_roll(remote, tok) for _ in range(3)]
    assert len({order for _, order, _ in runs}) > 1  # the steps finished in different orders
    assert all(data == runs[0][0] for data, _, _ in runs)
    assert any(t.num_turns == 3 for t in runs[0][2])  # some really are multi-turn
    # measured overlap: a step ran while another trajectory's request was in flight
    assert loop_metrics(runs[0][2])["perf/num_overlapped_steps"] >= 1
    # The same as the in-process HF engine answering each request on its own, with one thread as the service.
    hf = make_engine("hf", tiny_model_dir, tok, _rollout(svc.url))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _roll(OneAtATime(hf), tok)[0] == runs[0][0]
        # env.lockstep=true through the service = the lock-step loop of the in-process engine (no `concurrent`)
        assert _roll(remote, tok, lockstep=True)[0] == _roll(hf, tok)[0] != runs[0][0]
    finally:
        torch.set_num_threads(threads)
    remote.close()


class ConcurrentRemote(RemoteEngine):
    """The remote engine offered to concurrent callers: today's takes them in turn under its lock (thread-safe);
    the client on httpx sends them concurrently and says so itself."""

    concurrent = True


@pytest.mark.slow  # two short training runs
def test_a_remote_run_with_independent_trajectories_equals_the_in_process_one(tmp_path, tiny_model_dir, svc):
    from rollout.test_remote_train import _assert_same_run, _run

    for name, target in (("hf-concurrent", "multiturn_fakes:ConcurrentHF"), ("remote-concurrent", ConcurrentRemote)):
        if name not in ENGINES:
            ENGINES.register(name, target)
    env = ["task.env=multiturn_envs:SlowTryAgain", "rollout.max_new_tokens=16", "env.max_turns=3"]
    ref = _run(tmp_path / "hf", tiny_model_dir, "rollout.engine=hf-concurrent", *env)
    got = _run(tmp_path / "remote", tiny_model_dir, "rollout.engine=remote-concurrent",
               f"rollout.remote.urls=[{svc.url}]", "rollout.remote.timeout_s=5", *env)
    _assert_same_run(ref, got)
    stages = [r for r in read_metrics(got / "metrics.jsonl") if r["kind"] == "stage"]
    assert sum(r["perf/num_overlapped_steps"] for r in stages) >= 1  # the trajectories were independent
