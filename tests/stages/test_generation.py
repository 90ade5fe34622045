"""mugrpo.stages.generation's stage-0 line about tool use, worded from what happened: a run
whose every step ran past env.step_timeout_s was told "0% called a tool ... warm-start the model",
though every trajectory had called one."""
import pytest

from mugrpo.stages.generation import start_signal, tool_use_advice


@pytest.mark.unit
def test_steps_past_the_step_timeout_are_named_not_a_warm_start():
    env = {"env/tool_call_frac": 0.0, "env/tool_calls": 0.0, "env/tool_timeouts": 0.0, "env/num_env_timeout": 8.0}
    text = tool_use_advice(env)
    assert "0% of its trajectories called a tool (0 calls)" in text
    assert "8 trajectories ended with a step past env.step_timeout_s" in text and "raise env.step_timeout_s" in text
    assert "warm-start" not in text


@pytest.mark.unit
def test_every_call_timed_out_is_named():
    env = {"env/tool_call_frac": 1.0, "env/tool_calls": 6.0, "env/tool_timeouts": 6.0, "env/num_env_timeout": 0.0}
    text = tool_use_advice(env)
    assert "100% of its trajectories called a tool (6 calls, 6 past env.tool_timeout_s)" in text
    assert "Every tool call timed out: raise env.tool_timeout_s" in text and "warm-start" not in text


@pytest.mark.unit
def test_no_call_at_all_still_advises_a_warm_start():
    line = start_signal({"stage/zero_var_group_frac": 1.0}, {"env/tool_call_frac": 0.0, "env/tool_calls": 0.0}, {})
    assert "0% of its trajectories called a tool (0 calls). No trajectory called a tool" in line
    assert "warm-start the model" in line
    ok = tool_use_advice({"env/tool_call_frac": 0.5, "env/tool_calls": 3.0, "env/tool_timeouts": 1.0})
    assert ok == "; 50% of its trajectories called a tool (3 calls, 1 past env.tool_timeout_s)"
