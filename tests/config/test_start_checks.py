"""Config checks at start: dynamic_oversample's bound, an environment's own
max_turns, task.env_args that YAML cannot hold, `mugrpo plan` building the environment, and stop
strings that differ between the environments of one run."""
import functools
from types import SimpleNamespace

import pytest
import yaml

from mugrpo.cli import main
from mugrpo.config import ConfigError, dump_yaml, from_dict, load_config, to_dict
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.envs.build import build_env_factory

pytestmark = pytest.mark.unit

ENV_CFG = SimpleNamespace(max_turns=4, tool_timeout_s=1.0, step_isolation="thread")  # envs with class-level state


def _task(env, **args):
    return SimpleNamespace(env=env, env_args=args, tools=[])


class Echo(Environment):
    """Takes max_turns as an argument and does not check it (the factory try does)."""

    def __init__(self, max_turns: int = 3, marker=None, **extra):
        self.max_turns, self.marker, self.extra = max_turns, marker, extra

    def step(self, action):
        return StepResult([], 0.0, True)


class NoTurns(Environment):
    max_turns = 0

    def step(self, action):
        return StepResult([], 0.0, True)


class Alternating(Environment):
    """Every other instance stops on another string: a factory whose environments disagree."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.stop = ("</a>",) if type(self).made % 2 else ("</b>",)

    def step(self, action):
        return StepResult([], 0.0, True)


@pytest.mark.parametrize("value, ok", [(1, True), (16, True), (16.5, False), (1e9, False), (float("nan"), False)])
def test_dynamic_oversample_has_an_upper_bound(value, ok):
    # 1e9 x the stage's groups would be drawn in round 0, all held in memory: refused, naming the key.
    overrides = [f"rollout.dynamic_oversample={value}"]
    if ok:
        assert load_config(overrides=overrides).rollout.dynamic_oversample == value
    else:
        with pytest.raises(ConfigError, match=r"rollout.dynamic_oversample=.* is out of range; accepted: a number in "
                                              r"1..16"):
            load_config(overrides=overrides)


def test_dynamic_oversample_1e9_exits_2_naming_the_key(capsys):
    assert main(["plan", "rollout.dynamic_sampling=true", "rollout.dynamic_oversample=1e9"]) == 2
    assert "rollout.dynamic_oversample=1000000000.0 is out of range" in capsys.readouterr().err


def test_an_environments_own_max_turns_below_1_is_refused_at_the_factory_try():
    with pytest.raises(ConfigError, match=r"task.env_args.max_turns=0 is out of range; accepted: an integer >= 1"):
        build_env_factory(_task(Echo, max_turns=0), ENV_CFG)
    with pytest.raises(ConfigError, match=r"task.env \(NoTurns.max_turns\)=0 is out of range"):
        build_env_factory(_task(NoTurns), ENV_CFG)
    # From a factory that returns environments (not a class): the same check.
    with pytest.raises(ConfigError, match=r"task.env_args.max_turns=-1 is out of range"):
        build_env_factory(_task(lambda max_turns: Echo(max_turns), max_turns=-1), ENV_CFG)
    assert build_env_factory(_task(Echo, max_turns=1), ENV_CFG)().max_turns == 1


def test_an_environments_own_max_turns_below_1_exits_2(capsys):
    assert main(["plan", f"task.env={__name__}:Echo", "task.env_args={max_turns: 0}"]) == 2
    assert "task.env_args.max_turns=0 is out of range" in capsys.readouterr().err


def test_plan_with_an_environment_that_does_not_import_exits_2_naming_task_env(capsys):
    assert main(["plan", "task.env=no_such_module:Nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mugrpo: error: task.env:") and "no_such_module" in err


def test_plan_prints_the_environment_it_builds(capsys):
    assert main(["plan", "task.env=calculator", "env.max_turns=3"]) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines() if line.startswith("environment"))
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows == {"environment": "mugrpo.rollout.envs.builtin.CalculatorEnvironment",
                    "environment tools": "calculate", "environment max turns": "3",
                    "environment stop strings": "'</tool_call>'",
                    "environment isolation": "steps in threads of the trainer's process (a built-in environment, "
                                             "mugrpo's own code: env.step_isolation does not apply)"}
    assert main(["plan"]) == 0  # single-turn: no environment rows
    assert "environment" not in capsys.readouterr().out


def test_environments_of_one_run_with_different_stop_strings_are_refused_naming_it():
    with pytest.raises(ConfigError, match=r"task.env: two environments made by it stop a turn on different "
                                          r"strings \(Alternating: \('</a>',\), Alternating: \('</b>',\)\)"):
        build_env_factory(_task(Alternating), ENV_CFG)


class Opaque:
    """An object YAML's writer cannot represent."""


def test_env_args_yaml_cannot_hold_are_recorded_as_python_labels():
    cfg = load_config(overrides=[f"task.env={__name__}:Echo", "env.step_isolation=thread"])  # Opaque: in-process
    marker = Opaque()
    cfg.task.env_args = {"marker": marker, "pair": (1, 2), "fn": len}
    text = dump_yaml(cfg)  # before: yaml.representer.RepresenterError
    args = yaml.safe_load(text)["task"]["env_args"]
    assert args == {"marker": f"python:{__name__}.Opaque", "pair": [1, 2], "fn": "python:builtins.len"}
    assert cfg.task.env_args["marker"] is marker  # the live config keeps the object: the run uses it
    assert build_env_factory(cfg.task, cfg.env)().marker is marker
    # Read back from config.yaml (a resume), the label is refused at start, naming the key.
    reread = from_dict(to_dict(cfg))
    with pytest.raises(ConfigError, match=r"task.env_args.marker='python:.*Opaque' was a Python object passed to "
                                          r"mugrpo.train; a config file cannot hold it"):
        build_env_factory(reread.task, reread.env)


def test_a_python_object_in_env_args_runs_from_the_python_api(tmp_path, tiny_model_dir):
    import mugrpo
    from conftest import TINY_OVERRIDES

    marker = Opaque()
    config = dict(o.split("=", 1) for o in TINY_OVERRIDES)
    config = {k: yaml.safe_load(v) if v else "" for k, v in config.items()}
    config.update({"model.name": tiny_model_dir, "schedule.total_updates": 1, "schedule.num_stages": 1, "schedule.prompts_per_update": 2,
                   "rollout.group_size": 2, "eval.num_items": 0, "train.save_final_model": False,
                   "task.env_args": {"marker": marker}})
    result = mugrpo.train(config, run_dir=tmp_path / "run", environment=functools.partial(Echo, max_turns=1))
    assert len(result.metrics("update")) == 1
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["task"]
    assert saved["env_args"] == {"marker": f"python:{__name__}.Opaque"}
    assert saved["env"] == "python:functools.partial"
