"""mugrpo.rollout.envs.tools and the loop's tool metrics: a tool's own
"Error: ..." string counts as a failure when ``env.tool_error_prefix`` opts in (only a raise otherwise),
the tool counts are present as 0 when no trajectory reached a step, and the loop's wait for the tools
is a per-stage metric (``perf/tool_wait_s``)."""
import json
import time

import pytest

from mugrpo.config import ConfigError, load_config
from mugrpo.rollout.envs.build import build_env_factory
from mugrpo.rollout.envs.tools import ToolEnvironment
from mugrpo.rollout.multiturn import Trajectory, loop_metrics


def lookup(key: str) -> str:
    """Look a key up, TRL style: an error comes back as a string.

    Args:
        key: the key
    """
    return "42" if key == "answer" else f"Error: no key {key!r}"


def _call(**arguments):
    return f'<tool_call>{json.dumps({"name": "lookup", "arguments": arguments})}</tool_call>'


@pytest.mark.unit
def test_an_error_string_is_a_success_unless_the_prefix_opts_in():
    action = _call(key="answer") + _call(key="x") + _call(key="y")
    plain = ToolEnvironment([lookup]).step(action).metadata
    assert (plain["tool_calls"], plain["tool_errors"], plain["tool_reported_errors"]) == (3, 0, 0)
    result = ToolEnvironment([lookup], error_prefix="Error:").step(action)
    m = result.metadata
    assert (m["tool_calls"], m["tool_errors"], m["tool_reported_errors"], m["tool_errors/lookup"]) == (3, 2, 2, 2)
    # the model reads the tool's own text, unchanged
    assert [o["content"] for o in result.observations] == ["42", "Error: no key 'x'", "Error: no key 'y'"]
    t = Trajectory([1], None, 2, metadata=dict(m))
    t.end_reason = "done"
    assert loop_metrics([t])["env/tool_success_frac"] == pytest.approx(1 / 3)


@pytest.mark.unit
def test_the_config_key_reaches_the_tool_environment():
    cfg = load_config(overrides=["task.tools=[guard_tools:add]", "env.tool_error_prefix='Error:'"])
    assert build_env_factory(cfg.task, cfg.env)().error_prefix == "Error:"
    with pytest.raises(ConfigError, match="env.tool_error_prefix"):
        load_config(overrides=["env.tool_error_prefix=''"])


@pytest.mark.unit
def test_tool_counts_are_zero_not_absent_when_no_step_was_reached():
    trajs = [Trajectory([1], ToolEnvironment([lookup]), 2) for _ in range(3)]
    for t in trajs:
        t.end_reason = "overflow"  # each ended in its first policy turn: no step, no step metadata
    out = loop_metrics(trajs)
    assert out["env/tool_calls"] == 0 and out["env/tool_call_frac"] == 0 and out["env/num_with_tool_call"] == 0
    assert out["perf/tool_wait_s"] == 0 and out["env/tool_success_frac"] != out["env/tool_success_frac"]  # NaN


def test_the_loops_wait_for_tools_is_a_stage_metric():
    from mugrpo.rollout.multiturn import LoopLimits, _environment_turn

    def nap(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "ok"

    trajs = [Trajectory([1], ToolEnvironment([nap]), 2) for _ in range(2)]
    for t in trajs:
        t.final_text = '<tool_call>{"name": "nap", "arguments": {"seconds": 0.2}}</tool_call>'
        t.num_turns = 1
    limits = LoopLimits(max_turns=2, max_response_tokens=100, max_workers=2, step_timeout_s=5.0)
    _environment_turn(trajs, limits, lambda messages, eos: [7], eos=[0])
    for t in trajs:
        t.end_reason = "done"
    out = loop_metrics(trajs)
    # both calls slept 0.2 s, concurrently: the shares of the turn's wall-clock wait sum to at least that
    assert out["perf/tool_wait_s"] >= 0.2 and "env/step_wait_s" not in out
