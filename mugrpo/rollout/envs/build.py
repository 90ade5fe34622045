"""From the config (and what ``mugrpo.train`` was given) to the factory the rollout loop calls.

The keys read (their schema and documentation live with the config):

- ``task.env``: an environment: a name in :data:`mugrpo.rollout.envs.ENVIRONMENTS`, a
  ``"module:attr"`` path, or (from Python, ``mugrpo.train(environment=...)``) an
  :class:`Environment` subclass, a callable returning one, or a TRL ``environment_factory``
  (a callable returning an object with ``reset(**row)`` and tool methods);
- ``task.env_args``: keyword arguments of that environment;
- ``task.tools``: tools as ``"module:function"`` paths or (from Python, ``mugrpo.train(tools=...)``)
  functions; alone they make a :class:`ToolEnvironment`;
- ``env.max_turns`` and ``env.tool_timeout_s``: the defaults of an environment's ``max_turns`` and
  ``timeout_s`` when it takes them and ``task.env_args`` does not set them;
- ``env.tool_isolation``: ``process`` runs ``task.tools`` calls in worker processes
  (:func:`mugrpo.rollout.calls.process_tool_runner`).

Mistakes raise :class:`mugrpo.errors.ConfigError` naming the key, at start: the factory is tried
(two instances made and closed) before any stage runs, and what they are is checked: a ``max_turns``
of at least 1, and the same stop strings (one engine call samples a whole stage's turns, so its
environments must agree on where a turn ends). :func:`describe_env` says what the factory makes
(``mugrpo plan`` prints it). This module knows nothing about the loop.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

from mugrpo.errors import ConfigError, UserError
from mugrpo.rollout.calls import CallRunner, process_tool_runner
from mugrpo.rollout.envs import ENVIRONMENTS
from mugrpo.rollout.envs.base import EnvFactory, Environment
from mugrpo.rollout.envs.tools import FactoryEnvironment, ToolEnvironment, tool_schemas
from mugrpo.rollout.rewards import PYTHON_PREFIX

__all__ = ["build_env_factory", "describe_env", "resolve_tools", "task_score", "turn_budget_rows"]


def build_env_factory(task_cfg, env_cfg, task=None) -> Optional[EnvFactory]:
    """The per-trajectory factory ``task.env`` / ``task.tools`` describe, or None (single-turn).

    ``task`` (a :class:`mugrpo.rollout.tasks.Task`) lends its correctness to environments that take
    a ``score`` argument (``multi_attempt``)."""
    spec, args = getattr(task_cfg, "env", None), dict(getattr(task_cfg, "env_args", None) or {})
    tools = resolve_tools(getattr(task_cfg, "tools", None) or [])
    _refuse_labels(args)
    if spec is None:
        if args:
            raise ConfigError(f"task.env_args={args} without task.env: set task.env (one of "
                              f"{list(ENVIRONMENTS.names())})")
        if not tools:
            return None
        runner = process_tool_runner() if getattr(env_cfg, "tool_isolation", "thread") == "process" else None
        return _checked(functools.partial(ToolEnvironment, tools, env_cfg.max_turns, env_cfg.tool_timeout_s, runner),
                        "task.tools")
    if tools:
        raise ConfigError("task.tools with task.env: tools make their own environment (a tool environment); "
                          "give the tools to your environment's tools() instead, or drop task.env")
    target = _resolve_env(spec)
    if isinstance(target, type) and issubclass(target, Environment):
        return _checked(functools.partial(target, **_defaults(target, args, env_cfg, task)), "task.env_args",
                        "max_turns" in args)
    if not callable(target):
        raise ConfigError(f"task.env={spec!r} is a {type(target).__name__}, not an environment class or factory")
    return _from_callable(target, args, env_cfg)


def _resolve_env(spec) -> Any:
    if isinstance(spec, Environment):
        raise ConfigError("task.env is an environment instance; give its class (or a factory): one instance "
                          "serves one trajectory and the rollout loop makes one per trajectory")
    if not isinstance(spec, str):
        return spec
    if spec.startswith(PYTHON_PREFIX):
        raise ConfigError(f"task.env={spec!r} was a Python object passed to mugrpo.train; a config file cannot hold "
                          "it. Resume the run from Python with the same environment: mugrpo.train(run_dir=..., "
                          "environment=..., resume=True)")
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS.get(spec)
    if ":" not in spec:
        raise ConfigError(f"task.env={spec!r} is not a known environment; use one of {list(ENVIRONMENTS.names())} "
                          "or a 'module:Class' path")
    from mugrpo.rollout.rewards import load_function

    try:
        return load_function(spec, "environment")
    except UserError as exc:
        raise ConfigError(f"task.env: {exc}") from exc


def _defaults(cls, args: dict, env_cfg, task) -> dict:
    """``args`` plus the defaults for the arguments ``cls`` takes and ``args`` does not set."""
    params = inspect.signature(cls).parameters
    defaults = {"max_turns": env_cfg.max_turns, "timeout_s": env_cfg.tool_timeout_s}
    score = task_score(task) if task is not None else None
    if score is not None:
        defaults["score"] = score
    return {**{k: v for k, v in defaults.items() if k in params}, **args}


def _from_callable(make: Callable, args: dict, env_cfg) -> EnvFactory:
    """A callable returning an Environment, or a TRL ``environment_factory``."""
    try:
        probe = make(**args)
    except Exception as exc:  # noqa: BLE001 - user code: report, with the key
        raise ConfigError(f"task.env: calling {getattr(make, '__name__', make)!r} with task.env_args={args} "
                          f"failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(probe, Environment):
        _close_bounded([probe])
        return _checked(functools.partial(make, **args), "task.env", "max_turns" in args)
    if args:
        raise ConfigError(f"task.env_args={args}: a TRL environment_factory is called without arguments")
    return _checked(functools.partial(FactoryEnvironment, make, env_cfg.max_turns, env_cfg.tool_timeout_s),
                    "task.env")


def _checked(factory: EnvFactory, key: str, max_turns_given: bool = False) -> EnvFactory:
    """``factory`` once it has made (and closed) two environments with a valid ``max_turns`` and the
    same stop strings; ConfigError naming ``key`` if not (``task.env_args.max_turns`` when
    ``max_turns_given``: the value came from there)."""
    envs = []
    try:
        for _ in range(2):
            envs.append(factory())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    finally:
        _close_bounded(envs)
    first, second = envs
    name = type(first).__name__
    key = "task.tools" if key == "task.tools" else "task.env"  # what the environments are, not their arguments
    turns = getattr(first, "max_turns", None)
    if not (isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1):
        where = "task.env_args.max_turns" if max_turns_given else f"{key} ({name}.max_turns)"
        raise ConfigError(f"{where}={turns!r} is out of range; accepted: an integer >= 1 (policy turns per "
                          "trajectory; env.max_turns caps it too)")
    stops = [getattr(env, "stop", None) for env in envs]
    for env, stop in zip(envs, stops):
        if not (isinstance(stop, (tuple, list)) and all(isinstance(x, str) and x for x in stop)):
            raise ConfigError(f"{key}: {type(env).__name__}.stop={stop!r}; accepted: a tuple of non-empty strings")
    if tuple(stops[0]) != tuple(stops[1]):
        raise ConfigError(f"{key}: two environments made by it stop a turn on different strings ({name}: "
                          f"{tuple(stops[0])!r}, {type(second).__name__}: {tuple(stops[1])!r}); the environments of "
                          "one run must share their stop strings (one engine call samples every trajectory's "
                          "turn): give them the same stop tuple")
    return factory


def describe_env(factory: Optional[EnvFactory]) -> list[tuple[str, str]]:
    """(label, value) rows of what ``factory`` makes: its name, tools, max turns and stop strings
    (one instance made and closed); [] for a single-turn run."""
    if factory is None:
        return []
    env = factory()
    try:
        tools = [getattr(t, "__name__", type(t).__name__) for t in env.tools()]
        return [("environment", f"{type(env).__module__}.{type(env).__qualname__}"),
                ("environment tools", ", ".join(tools) if tools else "none"),
                ("environment max turns", str(env.max_turns)),
                ("environment stop strings", ", ".join(repr(s) for s in env.stop) if env.stop else "none (EOS only)")]
    finally:
        _close_bounded([env])


def turn_budget_rows(factory: Optional[EnvFactory], tokenizer, max_new_tokens: int, env_cfg) -> list[tuple[str, str]]:
    """(label, value) rows of what one environment turn costs in template tokens (an empty observation
    rendered by the model's tokenizer, :func:`mugrpo.rollout.envs.render.env_turn_ids`) and how many
    policy turns ``rollout.max_new_tokens`` allows at the per-turn cap; [] for a single-turn run."""
    from mugrpo.rollout.envs.render import env_turn_ids

    if factory is None:
        return []
    env = factory()
    try:
        role = "tool" if env.tools() else "user"
        turns = min(env_cfg.max_turns, env.max_turns)
    finally:
        _close_bounded([env])
    message = {"role": role, "content": ""} if role == "user" else {"role": "tool", "name": "tool", "content": ""}
    template = len(env_turn_ids(tokenizer, [message], True))
    per_turn = min(env_cfg.max_tokens_per_turn or max_new_tokens, max_new_tokens)
    # k policy turns at the cap, with k - 1 environment turns between them, fit when
    # k * per_turn + (k - 1) * template <= max_new_tokens (observations' own tokens come on top).
    fit = (max_new_tokens + template) // (per_turn + template)
    return [("env turn template", f"{template} tokens per environment turn (a {role} message, the model's "
                                          "chat template), plus the observation's own"),
            ("policy turn cap", f"{per_turn} tokens (env.max_tokens_per_turn"
                                f"{'' if env_cfg.max_tokens_per_turn else ' unset: rollout.max_new_tokens'})"),
            ("turns the budget allows", f"{fit} policy turns at the cap within rollout.max_new_tokens="
                                        f"{max_new_tokens} (max turns {turns}; fewer with long observations)")]


def _close_bounded(envs: list[Environment], timeout_s: float = 30.0) -> None:
    """Close the probe environments, each bounded; a close that raises or hangs is the loop's to
    count (every trajectory's close is), not a reason to refuse the environment here."""
    runner = CallRunner(1)
    for env in envs:
        runner.run([env.close], timeout_s, name="mugrpo-env-close")


def _refuse_labels(args: dict, key: str = "task.env_args") -> None:
    """A ``python:`` label read back from config.yaml stands for a Python object mugrpo.train was given in
    ``task.env_args``; the object itself is gone, so the environment cannot get it."""
    for name, value in args.items():
        where = f"{key}.{name}"
        if isinstance(value, dict):
            _refuse_labels(value, where)
        elif isinstance(value, str) and value.startswith(PYTHON_PREFIX):
            raise ConfigError(f"{where}={value!r} was a Python object passed to mugrpo.train; a config file cannot "
                              "hold it, so this run cannot get it back. Bind it into the environment instead "
                              "(environment=functools.partial(MyEnv, name=obj), which a resume from Python "
                              "passes again) and keep task.env_args to plain values")


def resolve_tools(specs: list) -> list[Callable]:
    """Tools from ``task.tools``: functions, or ``"module:function"`` paths imported now; each must
    describe itself (type hints, a docstring with ``Args:``)."""
    from mugrpo.rollout.rewards import load_function

    tools = []
    for spec in specs:
        if callable(spec):
            tools.append(spec)
        elif isinstance(spec, str) and spec.startswith(PYTHON_PREFIX):
            raise ConfigError(f"task.tools: {spec!r} was a Python function passed to mugrpo.train; a config file "
                              "cannot hold it. Resume the run from Python with the same tools: "
                              "mugrpo.train(run_dir=..., tools=[...], resume=True)")
        elif isinstance(spec, str) and ":" in spec:
            try:
                tools.append(load_function(spec, "tool"))
            except UserError as exc:
                raise ConfigError(f"task.tools: {exc}") from exc
        else:
            raise ConfigError(f"task.tools: {spec!r} is neither a function nor a 'module:function' path")
    try:
        tool_schemas(tools)
    except ValueError as exc:
        raise ConfigError(f"task.tools: {exc}") from exc
    return tools


def task_score(task) -> Optional[Callable]:
    """The task's correctness as ``score(text, item) -> float``: its evaluation reward when that is
    a built-in one, else its only built-in correctness reward (``boxed_format`` is not one); None
    when it has none (the user's own rewards)."""
    from mugrpo.rollout.tasks import _boxed_format

    rewards = task.rewards
    if task.eval_reward is not None and rewards[task.eval_reward].builtin:
        return rewards[task.eval_reward].fn
    correct = [r for r in rewards if r.builtin and not r.batched and r.fn is not _boxed_format]
    return correct[0].fn if len(correct) == 1 else None
