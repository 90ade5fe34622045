"""What an environment returns is checked before it is used: rewards and metadata are finite floats
(a reward of 1e300 would be inf as float32, an int too large for a float raises OverflowError), ``done``
is a bool, and an observation longer than ``max_observation_chars`` is cut before it is tokenized;
the policy's turns are capped by ``max_tokens_per_turn``. Each case counted, never a crash."""
import pytest

from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, first_problems, loop_counts, run_trajectories

EOS = 2


class OneToken:
    """Every turn: the token 5 then EOS; records the per-prompt caps it was given."""

    def __init__(self):
        self.caps = []

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        self.caps.append(list(max_new_tokens))
        return [[Completion([5, EOS], [-0.5, -0.5], "stop") for _ in range(sampling.n)] for _ in prompts]


class Returns(Environment):
    """Each step returns the next of ``results``."""

    def __init__(self, *results, metrics=None):
        self.results, self._metrics = list(results), metrics or {}

    def step(self, action):
        return self.results.pop(0)

    def metrics(self):
        return self._metrics


def run(envs, limits=LoopLimits(max_turns=3, max_response_tokens=64), seen=None):
    def render(messages, ended_on_eos):
        if seen is not None:
            seen.append([m["content"] for m in messages])
        return [7] * sum(len(m["content"]) for m in messages)

    ctx = LoopContext(OneToken(), None, limits, render_env_turn=render, decode=str, eos=[EOS])
    return run_trajectories(ctx, [[1]] * len(envs), envs, SamplingConfig(max_new_tokens=16, seed=0))


@pytest.mark.parametrize("result, says", [
    (StepResult([], reward=1e300, done=True), "reward 1e+300"),  # finite in float64, inf as float32
    (StepResult([], reward=10 ** 400, done=True), "reward 1000"),  # float() raises OverflowError
    (StepResult([], reward=float("nan"), done=True), "reward nan"),
    (StepResult([], reward=0.0, done="no"), "done='no', not a bool"),  # "no" is truthy: it counted as done
    (StepResult([], reward=0.0, done=None), "done=None, not a bool"),
])
def test_bad_rewards_and_done_end_the_trajectory_as_bad_output(result, says):
    [t] = run([Returns(result)])
    assert t.end_reason == "env_bad_output" and t.env_reward == 0.0 and says in t.error
    assert loop_counts([t])["env/num_env_bad_output"] == 1.0


def test_non_finite_metadata_and_metrics_are_dropped_and_counted():
    step = StepResult([], reward=1.0, done=True, metadata={"score": float("nan"), "big": 10 ** 400, "huge": 1e300,
                                                          "ok": 2, "text": "ignored"})
    [t] = run([Returns(step, metrics={"m": float("inf"), "fine": 0.5})])
    counts = loop_counts([t])
    assert t.end_reason == "done" and t.env_reward == 1.0
    assert counts["env/ok"] == 2.0 and counts["env/fine"] == 0.5
    assert counts["env/num_dropped_values"] == 4.0  # score, big, huge, m
    assert not any(k in counts for k in ("env/score", "env/big", "env/huge", "env/m"))
    assert "score=nan" in first_problems([t])["dropped_value"]


def test_a_long_observation_is_cut_before_it_is_rendered_and_counted():
    seen = []
    long = StepResult([{"role": "user", "content": "x" * 100_000}], reward=0.0, done=False)
    short = StepResult([{"role": "tool", "content": "fine"}], reward=0.0, done=False)
    limits = LoopLimits(max_turns=3, max_response_tokens=1000, max_observation_chars=50)
    [t] = run([Returns(long, short, StepResult([], done=True))], limits, seen)
    assert seen == [["x" * 50], ["fine"]]  # never rendered whole
    assert t.end_reason == "done" and loop_counts([t])["env/num_truncated_observations"] == 1.0


def test_the_per_turn_cap_is_passed_to_the_engine_below_the_trajectory_budget():
    obs = StepResult([{"role": "user", "content": "ab"}], reward=0.0, done=False)
    env = Returns(obs, StepResult([], done=True))
    engine = OneToken()
    ctx = LoopContext(engine, None, LoopLimits(max_turns=3, max_response_tokens=64, max_tokens_per_turn=6),
                      render_env_turn=lambda m, e: [7, 7], decode=str, eos=[EOS])
    run_trajectories(ctx, [[1]], [env], SamplingConfig(max_new_tokens=64, seed=0))
    assert engine.caps == [[6], [6]]
    # None: the trajectory's room, as before (64; then 64 - 2 sampled - 2 environment tokens = 60)
    engine = OneToken()
    ctx = LoopContext(engine, None, LoopLimits(max_turns=3, max_response_tokens=64),
                      render_env_turn=lambda m, e: [7, 7], decode=str, eos=[EOS])
    run_trajectories(ctx, [[1]], [Returns(obs, StepResult([], done=True))], SamplingConfig(max_new_tokens=64, seed=0))
    assert engine.caps == [[64], [60]]
