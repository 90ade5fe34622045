"""From config keys (task.env, task.env_args, task.tools, env.*) to the environment factory."""

from types import SimpleNamespace

import pytest

from mugrpo.errors import ConfigError
from mugrpo.rollout.envs import Environment, StepResult
from mugrpo.rollout.envs.build import build_env_factory, task_score
from mugrpo.rollout.envs.builtin import CalculatorEnvironment, MultiAttemptEnvironment, calculate
from mugrpo.rollout.envs.tools import FactoryEnvironment, ToolEnvironment
from mugrpo.rollout.rewards import RewardFn
from mugrpo.rollout.tasks import Item, Task

pytestmark = pytest.mark.unit

ENV = SimpleNamespace(max_turns=3, tool_timeout_s=2.5, step_isolation="thread")  # what is built, not where it runs


def task_cfg(env=None, env_args=None, tools=None):
    return SimpleNamespace(env=env, env_args=env_args or {}, tools=tools or [])


def test_no_env_and_no_tools_is_single_turn():
    assert build_env_factory(task_cfg(), ENV) is None


def test_tools_alone_make_a_tool_environment_with_the_env_defaults():
    factory = build_env_factory(task_cfg(tools=["mugrpo.rollout.envs.builtin:calculate"]), ENV)
    env = factory()
    assert type(env) is ToolEnvironment and [t.__name__ for t in env.tools()] == ["calculate"]
    assert (env.max_turns, env.timeout_s) == (3, 2.5)
    assert factory() is not env  # one instance per trajectory


def test_a_named_environment_gets_defaults_unless_its_args_set_them():
    env = build_env_factory(task_cfg("calculator"), ENV)()
    assert isinstance(env, CalculatorEnvironment) and (env.max_turns, env.timeout_s) == (3, 2.5)
    env = build_env_factory(task_cfg("calculator", {"max_turns": 5}), ENV)()
    assert (env.max_turns, env.timeout_s) == (5, 2.5)


def test_multi_attempt_scores_with_the_task_correctness():
    def exact(text, item):
        return float(text == item.answer)

    task = Task("t", [Item("q", "4")], [], [RewardFn("correctness", exact, builtin=True)])
    env = build_env_factory(task_cfg("multi_attempt", {"max_attempts": 2}), ENV, task)()
    assert isinstance(env, MultiAttemptEnvironment) and env.score is exact and env.max_turns == 2


def test_task_score_picks_correctness_not_the_format_reward():
    from mugrpo.rollout.tasks import _boxed_format

    def correct(text, item):
        return 1.0

    both = Task("t", [Item("q", "4")], [], [RewardFn("boxed_format", _boxed_format, 0.2, builtin=True),
                                           RewardFn("correctness", correct, builtin=True)])
    assert task_score(both) is correct
    own = Task("t", [Item("q", "4")], [], [RewardFn("mine", lambda p, c: [0.0], batched=True)])
    assert task_score(own) is None


class Echo(Environment):
    max_turns = 2

    def __init__(self, suffix: str = "!"):
        self.suffix = suffix

    def step(self, action):
        return StepResult([{"role": "user", "content": action + self.suffix}])


class Counter:
    """A TRL environment_factory class."""

    def reset(self, **row):
        self.n = 0

    def bump(self) -> int:
        """Add one."""
        self.n += 1
        return self.n


def test_python_environments_classes_factories_and_trl_factories():
    env = build_env_factory(task_cfg(Echo, {"suffix": "?"}), ENV)()
    assert isinstance(env, Echo) and env.step("a").observations[0]["content"] == "a?"
    env = build_env_factory(task_cfg(lambda: Echo("."), {}), ENV)()
    assert isinstance(env, Echo) and env.suffix == "."
    env = build_env_factory(task_cfg(Counter), ENV)()
    assert isinstance(env, FactoryEnvironment) and [t.__name__ for t in env.tools()] == ["bump"]
    assert (env.max_turns, env.timeout_s) == (3, 2.5)


def undocumented(x: int) -> int:
    return x


@pytest.mark.parametrize("cfg, says", [
    (task_cfg("calculater"), "task.env='calculater' is not a known environment"),
    (task_cfg("calculator", {"max_turn": 2}), "task.env_args: .*unexpected keyword argument 'max_turn'"),
    (task_cfg("multi_attempt", {"max_attempts": 0}), "task.env_args: max_attempts must be >= 1"),
    (task_cfg("nosuch_module:Env"), "task.env: .*cannot import module 'nosuch_module'"),
    (task_cfg(env_args={"max_turns": 2}), "task.env_args=.* without task.env"),
    (task_cfg("calculator", tools=[calculate]), "task.tools with task.env"),
    (task_cfg(Echo()), "environment instance; give its class"),
    (task_cfg(tools=[undocumented]), "task.tools: tool 'undocumented'.*docstring"),
    (task_cfg(tools=["calculate"]), "task.tools: 'calculate' is neither a function nor a 'module:function'"),
    (task_cfg(tools=["mugrpo.rollout.envs.builtin:nope"]), "task.tools: .*has no function 'nope'"),
    (task_cfg(Counter, {"x": 1}), "task.env: calling 'Counter' with task.env_args"),
    (task_cfg(lambda: 3), "task.env: environment_factory made a int without a reset"),
])
def test_mistakes_name_the_key(cfg, says):
    with pytest.raises(ConfigError, match=says):
        build_env_factory(cfg, ENV)
