"""The multi-turn loop's bookkeeping on hand-built trajectories (a scripted engine and scripted
environments, every id and log-prob known), its failure handling, and env-step concurrency."""
import threading
import time

import pytest

from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, loop_metrics, run_trajectories
from mugrpo.rollout.calls import run_calls

EOS = 2


class ScriptedEngine:
    """Returns the next scripted completions (one list per prompt) and records every call."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        self.calls.append((prompts, sampling, max_new_tokens))
        out = self.script.pop(0)
        assert len(out) == len(prompts) and all(len(g) == sampling.n for g in out)
        return out


class ScriptedEnv(Environment):
    """Step k returns steps[k]; a step may be an exception to raise, a float to sleep, or any value."""

    stop = ("</call>",)

    def __init__(self, steps, max_turns=4):
        self.steps, self.max_turns, self.actions, self.closed = list(steps), max_turns, [], False

    def step(self, action):
        self.actions.append(action)
        result = self.steps.pop(0)
        if isinstance(result, BaseException):
            raise result
        if isinstance(result, tuple) and result[0] == "sleep":
            time.sleep(result[1])
            result = result[2]
        return result

    def close(self):
        self.closed = True

    def metrics(self):
        return {"num_calls": float(len(self.actions))}


def user(text):
    return StepResult([{"role": "user", "content": text}])


def render(messages, ended_on_eos):
    # A stand-in renderer with known ids: 7 per character of content, then 8 (a "generation prompt");
    # an extra 9 first when the policy turn did not end on EOS (the template would close the turn).
    ids = [] if ended_on_eos else [9]
    for m in messages:
        ids += [7] * len(m["content"]) + [8]
    return ids


def decode(ids):
    return " ".join(map(str, ids))


def run(engine, prompts, envs, limits=LoopLimits(max_turns=4, max_response_tokens=64)):
    ctx = LoopContext(engine, None, limits, render_env_turn=render, decode=decode, eos=[EOS])
    return run_trajectories(ctx, prompts, envs, SamplingConfig(max_new_tokens=16, seed=5))


def test_hand_built_trajectories_keep_sampled_ids_and_env_ids_exactly():
    # Prompt [1, 3], G = 2. Trajectory 0: turn 0 samples 10 11 </call>-stop (no EOS), the env answers
    # "ab" (ids 9 7 7 8: a 9 since the turn did not end on EOS), turn 1 samples 12 EOS, the env says
    # done with reward 0.5. Trajectory 1: turn 0 samples 20 EOS, the env says done with reward 1.
    engine = ScriptedEngine([
        [[Completion([10, 11], [-0.1, -0.2], "stop"), Completion([20, EOS], [-0.5, -0.6], "stop")]],
        [[Completion([12, EOS], [-0.3, -0.4], "stop")]],
    ])
    envs = [ScriptedEnv([user("ab"), StepResult([], reward=0.5, done=True, metadata={"tool_calls": 1})]),
            ScriptedEnv([StepResult([], reward=1.0, done=True)])]
    t0, t1 = run(engine, [[1, 3]], envs)
    assert t0.response_ids == [10, 11, 9, 7, 7, 8, 12, EOS]
    assert t0.behavior_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3, -0.4]
    assert t0.turns == [0, 0, -1, -1, -1, -1, 1, 1]
    assert (t0.end_reason, t0.num_turns, t0.env_reward, t0.final_text) == ("done", 2, 0.5, f"12 {EOS}")
    assert envs[0].actions == ["10 11", f"12 {EOS}"]  # each step sees the decoded policy turn only
    assert (t1.response_ids, t1.turns, t1.end_reason, t1.env_reward) == ([20, EOS], [0, 0], "done", 1.0)
    # Turn 0: the prompt once with n = G = 2; turn 1: trajectory 0's ids so far, n = 1.
    (p0, s0, cap0), (p1, s1, cap1) = engine.calls
    assert (p0, s0.n, s0.stop) == ([[1, 3]], 2, ("</call>",))
    assert (p1, s1.n) == ([[1, 3, 10, 11, 9, 7, 7, 8]], 1)
    assert s0.seed != s1.seed  # each turn its own sampling stream
    assert cap0 == [16] and cap1 == [16]  # budget 64 - 6 = 58 left, capped by max_new_tokens 16 per turn
    assert envs[0].closed and envs[1].closed
    m = loop_metrics([t0, t1])
    assert m["env/num_done"] == 2 and m["env/tool_calls"] == 1 and m["env/num_calls"] == 3  # 2 + 1 steps
    assert (m["env/num_policy_tokens"], m["env/num_env_tokens"], m["env/turns_mean"]) == (6, 4, 1.5)


def test_turn_limit_length_and_overflow_end_trajectories_and_are_counted():
    # max_turns 2: trajectory 0's env never says done -> turn_limit after stepping its 2nd turn.
    # Trajectory 1's first turn hits the token limit ("length"): never stepped, truncated.
    engine = ScriptedEngine([
        [[Completion([10, EOS], [-1.0, -1.0], "stop"), Completion([5] * 16, [-1.0] * 16, "length")]],
        [[Completion([11, EOS], [-1.0, -1.0], "stop")]],
    ])
    envs = [ScriptedEnv([user("x"), user("y")], max_turns=2), ScriptedEnv([])]
    t0, t1 = run(engine, [[1]], envs)
    assert (t0.end_reason, t0.num_turns, t0.truncated) == ("turn_limit", 2, False)
    assert t0.turns == [0, 0, -1, -1, 1, 1]  # the final "y" turn is not appended
    assert (t1.end_reason, t1.truncated, envs[1].actions) == ("length", True, [])

    # Budget 8: 2 policy tokens, then the env's 6-id turn (7 x 5 + 8) would leave no room: overflow,
    # and the env turn is NOT appended (TRL's rule).
    engine = ScriptedEngine([[[Completion([10, EOS], [-1.0, -1.0], "stop")]]])
    (t,) = run(engine, [[1]], [ScriptedEnv([user("abcde")])], LoopLimits(max_turns=4, max_response_tokens=8))
    assert (t.end_reason, t.truncated, t.response_ids, t.turns) == ("overflow", True, [10, EOS], [0, 0])
    # The same turn fits a budget of 9: 2 + 6 < 9 leaves one token for the next policy turn.
    engine = ScriptedEngine([[[Completion([10, EOS], [-1.0, -1.0], "stop")]], [[Completion([3], [-1.0], "length")]]])
    (t,) = run(engine, [[1]], [ScriptedEnv([user("abcde")])], LoopLimits(max_turns=4, max_response_tokens=9))
    assert engine.calls[1][2] == [1] and t.end_reason == "length" and len(t.response_ids) == 9
    # The model context limits too: prompt 3 + 2 sampled + 6 env ids must stay below 10.
    engine = ScriptedEngine([[[Completion([10, EOS], [-1.0, -1.0], "stop")]]])
    limits = LoopLimits(max_turns=4, max_response_tokens=100, max_context=10)
    (t,) = run(engine, [[1, 1, 1]], [ScriptedEnv([user("abcde")])], limits)
    assert engine.calls[0][2] == [7] and t.end_reason == "overflow"


def test_failing_environments_end_their_trajectory_marked_and_never_crash():
    engine = ScriptedEngine([[[Completion([10, EOS], [-1.0, -1.0], "stop")] * 5]])
    envs = [ScriptedEnv([RuntimeError("boom")]), ScriptedEnv([("sleep", 5.0, user("late"))]),
            ScriptedEnv([{"not": "a StepResult"}]), ScriptedEnv([StepResult([{"role": "user", "content": 3}])]),
            ScriptedEnv([StepResult([], reward=float("nan"), done=True)])]
    t0 = time.monotonic()
    trajs = run(engine, [[1]], envs, LoopLimits(max_turns=4, max_response_tokens=64, step_timeout_s=0.3))
    assert time.monotonic() - t0 < 3.0  # the hung step was abandoned at its timeout, not awaited
    assert [t.end_reason for t in trajs] == ["env_error", "env_timeout", "env_bad_output", "env_bad_output",
                                             "env_bad_output"]
    assert "boom" in trajs[0].error and all(t.response_ids == [10, EOS] for t in trajs)
    m = loop_metrics(trajs)
    assert (m["env/num_env_error"], m["env/num_env_timeout"], m["env/num_env_bad_output"]) == (1, 1, 3)


def test_environments_that_disagree_on_stop_strings_are_refused():
    other = ScriptedEnv([])
    other.stop = ("</tool_call>",)
    with pytest.raises(ValueError, match="stop strings"):
        run(ScriptedEngine([]), [[1]], [ScriptedEnv([]), other])


def test_env_steps_run_concurrently_within_the_bound():
    # 8 steps of 0.4 s with 8 workers take ~0.4 s, not 3.2 s; with 2 workers ~1.6 s; at most
    # `max_workers` run at once.
    running, peak, lock = [0], [0], threading.Lock()

    def slow():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.4)
        with lock:
            running[0] -= 1
        return "ok"

    assert [r.value for r in run_calls([slow] * 8, max_workers=8, timeout_s=10)] == ["ok"] * 8
    assert peak[0] == 8  # all 8 ran at once (one after another, the peak would be 1)
    peak[0] = 0
    run_calls([slow] * 8, max_workers=2, timeout_s=10)
    assert peak[0] == 2


def test_a_timed_out_call_frees_its_slot():
    # One worker: a hung call times out after 0.2 s, then the next call still runs.
    results = run_calls([lambda: time.sleep(3), lambda: 42], max_workers=1, timeout_s=0.2)
    assert results[0].timed_out and not results[0].ok and results[1].value == 42


def test_loop_limits_from_the_env_config_section():
    from mugrpo.config import EnvConfig

    env = EnvConfig(max_turns=2, tool_timeout_s=1.0, step_timeout_s=5.0, max_workers=3)
    assert LoopLimits.from_config(env, 100, max_context=512) == LoopLimits(
        max_turns=2, max_response_tokens=100, max_context=512, step_timeout_s=5.0, max_workers=3)
    assert LoopLimits.from_config(env, 100).max_context is None  # evaluation passes no context
