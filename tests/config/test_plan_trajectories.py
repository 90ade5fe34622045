"""The plan says how multi-turn trajectories advance, and env.lockstep / env.max_inflight are validated."""
import pytest

from mugrpo.config import load_config
from mugrpo.config.plan import format_plan, make_plan
from mugrpo.errors import ConfigError

TOOLS = ["task.tools=[multiturn_envs:add]"]


def _row(*overrides) -> str:
    cfg = load_config(None, None, list(overrides))
    lines = [line for line in format_plan(make_plan(cfg), cfg).splitlines() if line.startswith("multi-turn")]
    return lines[0] if lines else ""


def test_the_plan_says_lockstep_on_an_in_process_engine_and_independent_on_a_remote_one():
    assert _row() == ""  # single-turn: no such row
    assert "lock-step: the in-process engine (rollout.engine=hf)" in _row(*TOOLS, "rollout.engine=hf")
    remote = [*TOOLS, "rollout.engine=remote", "rollout.remote.urls=[http://127.0.0.1:9]"]
    assert "independent" in _row(*remote) and "at most 64 requests in flight" in _row(*remote)
    assert "env.lockstep=true" in _row(*remote, "env.lockstep=true")


@pytest.mark.parametrize("override, key", [("env.max_inflight=0", "env.max_inflight"),
                                           ("env.lockstep=3", "env.lockstep")])
def test_bad_lockstep_or_max_inflight_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, None, [override])
