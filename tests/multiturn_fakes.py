"""A deterministic engine and environments for the multi-turn loop's mode tests (no model, no mocks of a
library: our own engine interface, implemented by a hash).

:class:`HashEngine` samples each sequence from a stream seeded by (the request's seed, its prompt, j):
what a sequence gets depends on its own request only, as with an HF service (one request at a time,
seeded per request), whatever else is in flight. It can be marked ``concurrent`` and records the calls,
the most requests in flight at once, and how long each call takes (``delay_s``)."""
import hashlib
import random
import threading
import time

from mugrpo.rollout.engines.base import Completion
from mugrpo.rollout.envs.base import Environment, StepResult

EOS = 2


def _stream(*parts) -> random.Random:
    return random.Random(hashlib.sha256(repr(parts).encode()).digest())


class HashEngine:
    """Tokens 3..39 drawn per sequence (EOS with probability 0.2), log-probs from the same stream."""

    def __init__(self, concurrent: bool = False, delay_s: float = 0.0):
        if concurrent:
            self.concurrent = True  # in-process engines have no such attribute: the loop treats it as False
        self.delay_s, self.calls, self.max_in_flight = delay_s, [], 0
        self.raised: list[BaseException] = []
        """What calls ended by (e.g. a stop raised from ``progress`` mid-call)."""
        self._in_flight, self._lock = 0, threading.Lock()

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            self.calls.append((tuple(map(tuple, prompts)), sampling.n, sampling.seed,
                               None if max_new_tokens is None else tuple(max_new_tokens)))
        try:
            end = time.monotonic() + self.delay_s
            while time.monotonic() < end:  # a generation that takes time, with heartbeats the caller may stop
                if progress is not None:
                    progress(0)
                time.sleep(min(0.01, max(0.0, end - time.monotonic())))
            caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
            return [[self._sample(p, sampling.seed, j, cap) for j in range(sampling.n)]
                    for p, cap in zip(prompts, caps)]
        except BaseException as exc:
            self.raised.append(exc)
            raise
        finally:
            with self._lock:
                self._in_flight -= 1

    @staticmethod
    def _sample(prompt, seed, j, cap) -> Completion:
        rng = _stream(seed, tuple(prompt), j)
        ids, logprobs = [], []
        while len(ids) < cap:
            token = EOS if rng.random() < 0.2 else rng.randrange(3, 40)
            ids.append(token)
            logprobs.append(-round(rng.random() * 4, 6))
            if token == EOS:
                return Completion(ids, logprobs, "stop")
        return Completion(ids, logprobs, "length")


def decode(ids) -> str:
    return " ".join(map(str, ids))


def render(messages, ended_on_eos):
    """Known ids: 7 per character of content, then 8; an extra 9 first when the turn did not end on EOS."""
    ids = [] if ended_on_eos else [9]
    for m in messages:
        ids += [7] * len(m["content"]) + [8]
    return ids


class Counting(Environment):
    """Deterministic given the actions: reward = tokens of the action / 10; done when the action holds a
    token 5 (or ends the loop's limits); the observation's length follows the action. ``latency`` is
    (lo, hi): each step sleeps a random time in it from an UNSEEDED stream, so trajectories finish in a
    different order every run while the results must not change."""

    max_turns = 4

    def __init__(self, latency=(0.0, 0.0), calls=None):
        self.latency, self.n = latency, 0
        self.calls = calls  # a list shared by a stage's environments: (env, start, end) of every step

    def step(self, action):
        start = time.monotonic()
        time.sleep(random.uniform(*self.latency))
        self.n += 1
        words = action.split()
        if self.calls is not None:
            self.calls.append((self, start, time.monotonic()))
        if "5" in words:
            return StepResult([], reward=len(words) / 10, done=True, metadata={"steps": 1.0})
        return StepResult([{"role": "user", "content": "x" * (1 + len(words) % 4)}], reward=len(words) / 10,
                          metadata={"steps": 1.0})


class ConcurrentHF:
    """The in-process HF engine offered to concurrent callers, answering one call at a time (what an HF
    service does), so that the loop runs independent trajectories on it. Registered by the tests that train
    with it as ``rollout.engine=hf-concurrent`` (:data:`LAUNCH`)."""

    concurrent = True

    def __init__(self, model_path, tokenizer, rollout_cfg, seed: int = 0):
        from mugrpo.rollout.engines.hf import HFEngine

        self.engine, self.lock = HFEngine(model_path, tokenizer, rollout_cfg, seed=seed), threading.Lock()

    def generate(self, *args, **kwargs):
        with self.lock:
            return self.engine.generate(*args, **kwargs)

    def load_weights(self, named_tensors):
        with self.lock:
            self.engine.load_weights(named_tensors)

    def __getattr__(self, name):  # sleep, wake, close, eos: the HF engine's
        return getattr(self.engine, name)


LAUNCH = ("import sys; from mugrpo.rollout.engines import ENGINES; "
          "ENGINES.register('hf-concurrent', 'multiturn_fakes:ConcurrentHF'); "
          "from mugrpo.cli import main; sys.exit(main(sys.argv[1:]))")
"""``python -c LAUNCH train ...``: the CLI with ``rollout.engine=hf-concurrent`` registered."""
