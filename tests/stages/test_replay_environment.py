"""Replaying an environment run: the stored prompts are checked against the prompt
as the environment renders it (its reset messages and its tools' instructions), so an identical
config replays a tool-environment run bitwise; a replay whose reward config differs from the
source's is refused naming the key (the stored rewards and advantages are the source's)."""
import pytest
from stages.test_replay_e2e import _cmd, _run, _updates

TOOL_ENV = ["task.env=calculator", "rollout.max_new_tokens=12", "env.max_turns=2", "task.max_prompt_tokens=1000"]


@pytest.fixture(scope="module")
def tool_source(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("src") / "run"
    r = _run(_cmd(run_dir, tiny_model_dir, *TOOL_ENV))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.slow  # ~30 s; tests/stages/test_replay_e2e.py keeps a multi-turn replay
def test_a_tool_environment_run_replays_with_an_identical_config(tmp_path, tiny_model_dir, tool_source):
    run_dir = tmp_path / "replay"
    r = _run(_cmd(run_dir, tiny_model_dir, *TOOL_ENV, "--replay", str(tool_source)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _updates(run_dir) == _updates(tool_source)  # the same stage data, the same updates


@pytest.mark.parametrize("key, overrides", [("task.reward_fn", ["task.reward_fn=toy_rewards:raises"]),
                                            ("task.rewards", ["task.reward_fn=null", "task.rewards=[correctness]"])])
@pytest.mark.slow  # ~34 s (its source run); tests/stages/test_replay_e2e.py keeps a refused replay
def test_a_replay_with_another_reward_is_refused_naming_the_key(tmp_path, tiny_model_dir, tool_source, key,
                                                                overrides):
    r = _run(_cmd(tmp_path / "replay", tiny_model_dir, *TOOL_ENV, *overrides, "--replay", str(tool_source)))
    assert r.returncode == 2, r.stderr[-3000:]
    assert key in r.stderr and "rewards" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "replay").exists()
