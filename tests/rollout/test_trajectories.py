"""Independent trajectories (mugrpo/rollout/trajectories.py) against the lock-step loop, on a hash engine whose
samples depend on each request alone (tests/multiturn_fakes.py): results do not depend on the order steps
finish in nor on the bound on requests in flight; lock-step is the loop of before (its calls and trajectories
equal stored expectations from commit 64f6cbb); an in-process engine always runs lock-step; tools and
generation overlap; a stop or an engine error ends the loop with nothing left running."""
import hashlib
import threading
import time

import pytest
from multiturn_fakes import EOS, Counting, HashEngine, decode, render

from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, loop_counts, loop_metrics, run_trajectories
from mugrpo.rollout.trajectories import Occupancy, Stopped
from mugrpo.seeds import derive

G, SEED = 4, 11
PROMPTS = [[1, 3 + g] for g in range(3)]
# Recorded with the loop of commit 64f6cbb (before independent trajectories) on this engine and these
# environments: sha256 of every trajectory (ids, log-probs, turns, end, reward, turns taken) and of every
# engine call (prompts, n, seed, per-prompt limits). Pure functions of sha256 and Python's random: the same
# on every machine.
OLD_TRAJECTORIES = "298f10ca6e3fcce340f85af027b2d0d286d1f99457ae7ce164948e503b772886"
OLD_CALLS = "4e8d80ece33395c79ace30ad921029acfb87afe5c4dee12ea40c880e47cd084f"
# The independent mode's, recorded when it was written: a change here changes every resumed run's stages.
INDEPENDENT_TRAJECTORIES = "e6b181f945f9d586"


def roll(engine, latency=(0.0, 0.0), progress=None, envs=None, **limits):
    limits = {"max_turns": 4, "max_response_tokens": 30, "max_tokens_per_turn": 9, **limits}
    ctx = LoopContext(engine, None, LoopLimits(**limits),
                      render_env_turn=render, decode=decode, eos=[EOS])
    envs = envs if envs is not None else [Counting(latency) for _ in range(len(PROMPTS) * G)]
    return run_trajectories(ctx, PROMPTS, envs, SamplingConfig(max_new_tokens=12, seed=SEED), progress=progress)


def digest(trajs) -> str:
    out = [(t.response_ids, t.behavior_logprobs, t.turns, t.end_reason, t.env_reward, t.num_turns) for t in trajs]
    return hashlib.sha256(repr(out).encode()).hexdigest()


@pytest.mark.parametrize("engine, lockstep", [(HashEngine(), False), (HashEngine(), True),
                                              (HashEngine(concurrent=True), True)],
                         ids=["in-process", "in-process, lockstep", "concurrent, lockstep"])
def test_lockstep_and_in_process_engines_run_the_loop_of_before(engine, lockstep):
    trajs = roll(engine, lockstep=lockstep)
    assert digest(trajs) == OLD_TRAJECTORIES
    assert hashlib.sha256(repr(engine.calls).encode()).hexdigest() == OLD_CALLS
    assert len(engine.calls) == 4  # one call per turn, every trajectory in it


def test_independent_results_do_not_depend_on_step_order_or_the_bound_on_requests():
    finish_orders, digests = [], set()
    for max_inflight in (1, 3, 64, 64):
        ends = []
        envs = [Counting((0.0, 0.03), calls=ends) for _ in range(len(PROMPTS) * G)]
        engine = HashEngine(concurrent=True, delay_s=0.005)
        trajs = roll(engine, envs=envs, max_inflight=max_inflight)
        digests.add(digest(trajs))
        finish_orders.append(tuple(envs.index(env) for env, _, _ in sorted(ends, key=lambda call: call[2])))
        assert engine.max_in_flight <= max_inflight
    assert len(set(finish_orders)) > 1  # the steps did finish in different orders (random latencies)
    assert digests == {digest(trajs)} and digest(trajs).startswith(INDEPENDENT_TRAJECTORIES)
    assert digest(trajs) != OLD_TRAJECTORIES  # the modes seed their requests differently
    counts = loop_counts(trajs)
    # several ways to end, several turns: the comparison above covers the loop's branches
    assert counts["env/num_done"] >= 1 and counts["env/num_length"] >= 1 and counts["env/num_turn_limit"] >= 1


def test_independent_requests_are_one_per_group_then_one_per_trajectory_seeded_by_position():
    engine = HashEngine(concurrent=True)
    trajs = roll(engine)
    first = [c for c in engine.calls if c[1] == G]
    later = [c for c in engine.calls if c[1] == 1]
    # turn 0: one request per group, its prompt once, n = G, seeded by the group's index
    assert sorted((c[0], c[2]) for c in first) == sorted(
        ((tuple(p),), derive(SEED, "multiturn-group", g)) for g, p in enumerate(PROMPTS))
    # turn k >= 1: one request per trajectory and turn, its ids so far as the prompt
    assert len(later) == sum(t.num_turns - 1 for t in trajs) and len(first) + len(later) == len(engine.calls)
    want = {derive(SEED, "multiturn-trajectory", i, k) for i, t in enumerate(trajs) for k in range(1, t.num_turns)}
    assert {c[2] for c in later} == want
    for prompts, _, _, caps in engine.calls:  # every request: one prompt, its cap within the trajectory budget
        assert len(prompts) == 1 and 1 <= caps[0] <= 9


def test_tools_and_generation_overlap_only_in_independent_mode():
    steps_lock, steps_ind = [], []
    lock = roll(HashEngine(concurrent=True, delay_s=0.02), envs=[Counting((0.02, 0.02), steps_lock) for _ in range(12)],
                lockstep=True)
    ind = roll(HashEngine(concurrent=True, delay_s=0.02), envs=[Counting((0.02, 0.02), steps_ind) for _ in range(12)])
    m_lock, m_ind = loop_metrics(lock), loop_metrics(ind)
    assert m_lock["perf/num_overlapped_steps"] == 0
    # Measured: in independent mode a step ran while another trajectory's request was in flight. The first
    # turn's requests end together per group, so not every step overlaps; most do.
    assert m_ind["perf/num_overlapped_steps"] >= len(steps_ind) // 2 and len(steps_ind) >= 12
    for m in (m_lock, m_ind):
        assert 0 < m["perf/engine_busy_frac"] <= 1 and m["perf/env_wait_s"] >= 0
    assert m_ind["perf/engine_busy_frac"] > m_lock["perf/engine_busy_frac"]


def test_occupancy_counts_busy_time_tool_wait_and_overlapped_steps():
    occ = Occupancy()
    occ.step_started(0)        # a step alone: tool wait
    time.sleep(0.02)
    occ.request_started()      # a request joins it: step 0 overlapped, engine busy
    time.sleep(0.02)
    assert occ.step_ended(0) is True
    occ.step_started(1)        # starts while the request runs: overlapped
    occ.request_ended()
    assert occ.step_ended(1) is True
    occ.step_started(2)        # no request during it
    assert occ.step_ended(2) is False
    occ.close()
    assert occ.tool_wait_s >= 0.02 and occ.busy_s >= 0.02 and (occ.requests, occ.steps) == (0, 0)


class Stop(Exception):
    pass


def test_a_stop_raised_from_progress_ends_the_loop_with_nothing_in_flight():
    engine = HashEngine(concurrent=True, delay_s=0.3)  # requests long enough to be stopped mid-call
    steps = []
    envs = [Counting((0.05, 0.05), steps) for _ in range(12)]
    beats = []

    def progress(n):
        beats.append(n)
        if len(engine.calls) > len(PROMPTS):  # a later turn's requests are in flight: stop now
            raise Stop()

    with pytest.raises(Stop):
        roll(engine, progress=progress, envs=envs)
    # the requests in flight were stopped mid-call (from their heartbeat), not run to their end
    assert engine.raised and all(isinstance(e, Stopped) for e in engine.raised)
    assert engine._in_flight == 0  # no request left running, nor a step (the loop waited for them)
    assert all(end <= time.monotonic() for _, _, end in steps) and 0 in beats


def test_an_engine_error_propagates_after_the_other_requests_stop():
    class Failing(HashEngine):
        def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
            if sampling.n == 1:
                raise RuntimeError("service gone")
            return super().generate(prompts, sampling, progress, max_new_tokens)

    engine = Failing(concurrent=True, delay_s=0.05)
    with pytest.raises(RuntimeError, match="service gone"):
        roll(engine)
    assert engine._in_flight == 0


class Failures(Environment):
    """Each trajectory's environment fails its way: by index, raise / hang past the timeout / bad output / done."""

    max_turns = 4

    def __init__(self, kind):
        self.kind = kind

    def step(self, action):
        if self.kind == 0:
            raise ValueError("tool broke")
        if self.kind == 1:
            time.sleep(0.5)
        if self.kind == 2:
            return "not a StepResult"
        return StepResult([], reward=1.0, done=True)


def test_independent_mode_ends_trajectories_on_environment_failures_as_lockstep_does():
    # G = 4 per prompt, kinds by trajectory: each failure once per group. Trajectories that end on their
    # first policy turn ("length") never step; the others end by their environment's kind.
    for concurrent in (False, True):
        envs = [Failures(i % 4) for i in range(12)]
        trajs = roll(HashEngine(concurrent=concurrent), envs=envs, step_timeout_s=0.2)
        stepped = [(i % 4, t.end_reason) for i, t in enumerate(trajs) if t.end_reason != "length"]
        assert stepped and all(reason == ["env_error", "env_timeout", "env_bad_output", "done"][k]
                               for k, reason in stepped)
        assert all("tool broke" in t.error for i, t in enumerate(trajs) if t.end_reason == "env_error")


def test_the_bound_on_requests_in_flight_holds():
    engine = HashEngine(concurrent=True, delay_s=0.02)
    roll(engine, max_inflight=2)
    assert engine.max_in_flight == 2  # reached (3 groups start at once) and never passed


def test_max_inflight_must_be_positive():
    with pytest.raises(ValueError, match="max_inflight >= 1"):
        LoopLimits(max_inflight=0)


def test_heartbeats_reach_progress_while_requests_run():
    engine = HashEngine(concurrent=True, delay_s=0.6)
    beats = []
    lock = threading.Lock()

    def progress(n):
        with lock:
            beats.append(n)

    trajs = roll(engine, progress=progress, max_turns=1)
    assert beats.count(0) >= 2  # at least every 0.25 s during the 0.6 s requests
    assert sum(beats) == len(trajs)  # every trajectory reported once, when it ended
