"""Config keys of environments and tools: task.env, task.env_args, task.tools and the env section."""

import pytest

from mugrpo.cli import main
from mugrpo.config import ConfigError, dump_yaml, from_dict, load_config, to_dict, validate
from mugrpo.rollout.envs.builtin import CalculatorEnvironment, calculate

pytestmark = pytest.mark.unit


def test_defaults_are_single_turn():
    cfg = load_config()
    assert (cfg.task.env, cfg.task.env_args, cfg.task.tools) == (None, {}, [])
    assert (cfg.env.max_turns, cfg.env.tool_timeout_s, cfg.env.step_timeout_s, cfg.env.max_workers) == (4, 10.0, 30.0, 8)


def test_env_keys_load_from_overrides():
    cfg = load_config(overrides=["task.env=multi_attempt", "task.env_args={max_attempts: 3}", "env.max_turns=3"])
    assert (cfg.task.env, cfg.task.env_args, cfg.env.max_turns) == ("multi_attempt", {"max_attempts": 3}, 3)
    cfg = load_config(overrides=["task.tools=[mugrpo.rollout.envs.builtin:calculate]"])
    assert cfg.task.tools == ["mugrpo.rollout.envs.builtin:calculate"]


@pytest.mark.parametrize("args, needle", [
    (["task.env=calculater"], "task.env='calculater' is not a known option; accepted: "),  # then the names
    (["task.env_args=3"], "task.env_args: got 3 (int); expected dict"),
    (["task.env=calculator", "task.tools=[m:f]"], "task.tools and task.env are both set"),
    (["task.tools=[calculate]"], "task.tools[0]='calculate' is out of range; accepted: a 'module:function' path"),
    (["env.max_turns=0"], "env.max_turns=0 is out of range; accepted: 1..127"),
    (["env.max_turns=128"], "env.max_turns=128 is out of range"),
    (["env.tool_timeout_s=0"], "env.tool_timeout_s=0.0 is out of range"),
    (["env.step_timeout_s=.inf"], "env.step_timeout_s=inf is out of range"),
    (["env.max_workers=0"], "env.max_workers=0 is out of range"),
    (["env.tool_timeout_s=30"], "env.tool_timeout_s=30.0 is not below env.step_timeout_s=30.0"),
    (["env.max_turn=3"], "unknown config key 'env.max_turn'. Did you mean 'env.max_turns'?"),
])
def test_mistakes_exit_2_naming_the_key(args, needle, capsys):
    assert main(["plan", *args]) == 2
    assert needle in capsys.readouterr().err


def test_python_objects_are_recorded_by_name_and_read_back_as_labels():
    cfg = load_config()
    cfg.task.env, cfg.task.env_args = CalculatorEnvironment, {"max_turns": 2}
    validate(cfg)
    data = to_dict(cfg)
    assert data["task"]["env"] == "python:mugrpo.rollout.envs.builtin.CalculatorEnvironment"
    assert "CalculatorEnvironment" in dump_yaml(cfg)
    assert from_dict(data).task.env == "python:mugrpo.rollout.envs.builtin.CalculatorEnvironment"
    cfg = load_config()
    cfg.task.tools = [calculate, "mugrpo.rollout.envs.builtin:calculate"]
    assert to_dict(cfg)["task"]["tools"] == ["python:mugrpo.rollout.envs.builtin.calculate",
                                             "mugrpo.rollout.envs.builtin:calculate"]
    assert cfg.task.tools[0] is calculate  # the live config keeps the function


def test_a_python_label_cannot_be_built_from_a_config_file():
    from types import SimpleNamespace

    from mugrpo.rollout.envs.build import build_env_factory

    env = SimpleNamespace(max_turns=2, tool_timeout_s=1.0)
    with pytest.raises(ConfigError, match="was a Python object passed to mugrpo.train.*environment=...,"):
        build_env_factory(SimpleNamespace(env="python:m.Env", env_args={}, tools=[]), env)
    with pytest.raises(ConfigError, match="was a Python function passed to mugrpo.train.*tools=\\[...\\]"):
        build_env_factory(SimpleNamespace(env=None, env_args={}, tools=["python:m.f"]), env)


def test_a_python_object_that_is_not_an_environment_is_refused():
    cfg = load_config()
    cfg.task.env = 3
    with pytest.raises(ConfigError, match="task.env=3: an environment name"):
        validate(cfg)


def test_resume_puts_back_the_python_tools_and_environment(tmp_path):
    from mugrpo.api import _resumed_environment

    def resumed(env, tools, given_tools=None, given_env=None):
        cfg = load_config()
        cfg.task.env, cfg.task.tools = env, tools
        _resumed_environment(cfg, tmp_path, given_tools, given_env)
        return cfg.task.env, cfg.task.tools

    label = "python:mugrpo.rollout.envs.builtin.CalculatorEnvironment"
    assert resumed(label, [], given_env=CalculatorEnvironment) == (CalculatorEnvironment, [])
    assert resumed("calculator", []) == ("calculator", [])  # a name in config.yaml needs nothing
    assert resumed(None, ["python:mugrpo.rollout.envs.builtin.calculate"], [calculate]) == (None, [calculate])
    with pytest.raises(ConfigError, match="trained with environment .*CalculatorEnvironment.*got None"):
        resumed(label, [])
    with pytest.raises(ConfigError, match="trained with environment 'calculator'.*or drop it"):
        resumed("calculator", [], given_env="multi_attempt")
    with pytest.raises(ConfigError, match="trained with tools .*calculate.*got \\[\\]"):
        resumed(None, ["python:mugrpo.rollout.envs.builtin.calculate"])
