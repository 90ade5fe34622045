"""The plan says how multi-turn trajectories advance, and env.lockstep / env.max_inflight are validated."""
import pytest

from mugrpo.config import load_config
from mugrpo.config.plan import format_plan, make_plan
from mugrpo.errors import ConfigError
from mugrpo.rollout.engines import ENGINES

TOOLS = ["task.tools=[multiturn_envs:add]"]


def _row(*overrides) -> str:
    cfg = load_config(None, None, list(overrides))
    lines = [line for line in format_plan(make_plan(cfg), cfg).splitlines() if line.startswith("multi-turn")]
    return lines[0] if lines else ""


def test_the_plan_says_lockstep_on_an_in_process_engine_and_independent_on_a_concurrent_one():
    assert _row() == ""  # single-turn: no such row
    assert "lock-step: rollout.engine=hf serves one call at a time" in _row(*TOOLS, "rollout.engine=hf")
    if "hf-concurrent" not in ENGINES:
        ENGINES.register("hf-concurrent", "multiturn_fakes:ConcurrentHF")
    concurrent = [*TOOLS, "rollout.engine=hf-concurrent"]
    assert "independent" in _row(*concurrent) and "at most 64 requests in flight" in _row(*concurrent)
    assert "at most 5 requests" in _row(*concurrent, "env.max_inflight=5")
    assert "lock-step (env.lockstep=true" in _row(*concurrent, "env.lockstep=true")


@pytest.mark.parametrize("override, key", [("env.max_inflight=0", "env.max_inflight"),
                                           ("env.lockstep=3", "env.lockstep")])
def test_bad_lockstep_or_max_inflight_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, None, [override])
