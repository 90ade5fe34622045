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
- ``env.tool_isolation``: ``process`` (the default) runs ``task.tools`` calls in worker processes
  (:func:`mugrpo.rollout.calls.process_tool_runner`), and the tool environment itself (mugrpo's
  code) in the trainer's process;
- ``env.step_isolation``: ``process`` (the default) makes each environment of ``task.env`` in a
  worker process of its own (:class:`mugrpo.rollout.envs.isolated.ProcessEnvironment`).

User code that cannot cross to a worker process (a class or function defined inside a function or
in the script being run, an object that does not pickle) runs on threads instead, with a one-line
warning saying why (:func:`portable_problem`): the run still works, without the isolation. A
constructor that ends its process (``os._exit``, a crash) at the start-up check is a ConfigError
naming it, without a traceback (exit 2).

Mistakes raise :class:`mugrpo.errors.ConfigError` naming the key, at start: the factory is tried
(two instances made and closed, each call bounded by ``env.reset_timeout_s``, an exception or a
timeout reported with the key) before any stage runs, and what they are is checked: a ``max_turns``
of at least 1, and the same stop strings (one engine call samples a whole stage's turns, so its
environments must agree on where a turn ends). What the first instance was is kept with the factory
(:class:`CheckedFactory`, its :class:`EnvSummary`); :func:`describe_env` and :func:`turn_budget_rows`
say it from there, without making another environment (``mugrpo plan`` and ``mugrpo train`` print
it, and a run's environment calls, which a hostile environment may count, are the same with or
without it). This module knows nothing about the loop.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mugrpo.errors import ConfigError, UserError
from mugrpo.rollout.calls import CallRunner, ProcessExit, process_tool_runner
from mugrpo.rollout.envs import ENVIRONMENTS
from mugrpo.rollout.envs.base import EnvFactory, Environment
from mugrpo.rollout.envs.isolated import NotPortable, ProcessEnvironment
from mugrpo.rollout.envs.start import env_name
from mugrpo.rollout.envs.tools import FactoryEnvironment, ToolEnvironment, tool_schemas
from mugrpo.rollout.rewards import PYTHON_PREFIX

__all__ = ["build_env_factory", "start_tool_workers", "describe_env", "resolve_tools", "task_score", "turn_budget_rows", "CheckedFactory",
           "EnvSummary", "format_rows"]


@dataclass(frozen=True)
class EnvSummary:
    """What the start-up check's first environment was."""

    name: str
    """``module.QualName`` of its class."""
    tools: tuple[str, ...]
    """Its tools' names (``()`` also when ``tools()`` failed: ``tools_error`` says so)."""
    tools_error: Optional[str]
    """Why ``tools()`` gave no list (it raised or hung), or None."""
    max_turns: int
    stop: tuple[str, ...]
    isolation: str = "steps in a worker process per environment (env.step_isolation=process)"
    """Where the environment's steps and its tool calls run, for the start-up line."""


class CheckedFactory(functools.partial):
    """An environment factory (a ``functools.partial``) that passed the start-up check; ``summary``:
    what its first environment was."""

    summary: EnvSummary


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
        runner = process_tool_runner() if _tools_in_processes(tools, env_cfg) else None
        factory = functools.partial(ToolEnvironment, tools, env_cfg.max_turns, env_cfg.tool_timeout_s, runner,
                                    error_prefix=getattr(env_cfg, "tool_error_prefix", None))
        # The tool environment is mugrpo's code: with its tools in worker processes it needs no worker itself.
        return _checked(factory if runner is not None else _isolated(factory, env_cfg), "task.tools", _timeout(env_cfg))
    if tools:
        raise ConfigError("task.tools with task.env: tools make their own environment (a tool environment); "
                          "give the tools to your environment's tools() instead, or drop task.env")
    target = _resolve_env(spec)
    if isinstance(target, type) and issubclass(target, Environment):
        factory = functools.partial(target, **_defaults(target, args, env_cfg, task))
        return _checked(factory if spec in THREAD_BUILTINS else _isolated(factory, env_cfg),
                        "task.env_args", _timeout(env_cfg), "max_turns" in args)
    if not callable(target):
        raise ConfigError(f"task.env={spec!r} is a {type(target).__name__}, not an environment class or factory")
    return _from_callable(target, args, env_cfg)


THREAD_BUILTINS = ("calculator", "multi_attempt")
"""Built-in environments (by ``task.env`` name) whose steps run on threads whatever ``env.step_isolation``
says: their code is mugrpo's own (the calculator's parser, the task's built-in correctness), so a
worker process per environment (about 60 ms to start, one process per live trajectory:
docs/ENVIRONMENTS.md) would buy nothing. ``task.env=mugrpo.rollout.envs.builtin:CalculatorEnvironment``
follows ``env.step_isolation``."""


class _ImportModules:
    """A worker's warm-up call (picklable): import the tools' modules, as their first call would."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = modules

    def __call__(self) -> None:
        import importlib

        for name in self.modules:
            importlib.import_module(name)


def portable_problem(obj) -> Optional[str]:
    """Why ``obj`` (a factory, a tool) cannot run in a worker process, or None: it must pickle, and by a
    module the worker can import (not the script being run: the worker would run it again)."""
    inner = getattr(obj, "func", obj)
    module = getattr(inner, "__module__", None) or getattr(type(inner), "__module__", None)
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    if module == "__main__":
        return f"{name} is defined in the script being run (__main__); define it in a module"
    try:
        pickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - pickling user objects may raise anything
        return f"{name} does not pickle ({type(exc).__name__}: {exc}); define it at a module's top level"
    return None


def _thread_fallback(key: str, why: str) -> None:
    print(f"[mugrpo] warning: {key}=process: {why}, so it runs on threads of the trainer's process instead (an "
          "os._exit or a hang is still caught; a crash in native code or a call holding the GIL is not)",
          file=sys.stderr, flush=True)


def _tools_in_processes(tools: list, env_cfg) -> bool:
    """Whether ``task.tools`` run in worker processes: ``env.tool_isolation=process`` and every tool portable."""
    if getattr(env_cfg, "tool_isolation", "process") != "process":
        return False
    for tool in tools:
        if (why := portable_problem(tool)) is not None:
            _thread_fallback("env.tool_isolation", f"tool {why}")
            return False
    return True


def start_tool_workers(task_cfg, env_cfg) -> Optional[str]:
    """With ``task.tools`` under ``env.tool_isolation=process``: start the tool worker processes now (one
    per environment step that may run at once, ``env.max_workers``, up to the runner's 16), each with
    the tools' modules imported, before any step's clock starts, so no call and no step
    (``env.step_timeout_s``) waits for a worker's start-up (with a 5 s step timeout every call
    timed out before its tool ran). Returns the line to print, or None (nothing to start). A worker
    that fails to start is a ConfigError naming the key."""
    tools = resolve_tools(getattr(task_cfg, "tools", None) or [])
    if not tools or task_cfg.env is not None or getattr(env_cfg, "tool_isolation", "process") != "process" \
            or any(portable_problem(t) is not None for t in tools):
        return None
    runner = process_tool_runner()
    count = min(env_cfg.max_workers, runner.max_workers)
    modules = tuple(sorted({getattr(t, "__module__", None) for t in tools} - {None, "__main__"}))
    try:
        seconds = runner.prestart(count, _ImportModules(modules))
    except Exception as exc:  # noqa: BLE001 - a worker that cannot start: the run cannot use the isolation
        raise ConfigError(f"env.tool_isolation=process: a tool worker process did not start ({exc}); the tools "
                          "must import in a fresh process (module-level functions), or use env.tool_isolation=thread"
                          ) from exc
    return (f"[mugrpo] env.tool_isolation=process: {count} tool worker processes started in {seconds:.1f} s, before "
            "the first step: their start-up counts against no call (env.tool_timeout_s) and no step "
            "(env.step_timeout_s)")


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
    r = CallRunner(1).run([lambda: make(**args)], _timeout(env_cfg), name="mugrpo-env-check")[0]
    if not r.ok:  # user code: report, with the key
        why = (f"ran past env.reset_timeout_s={_timeout(env_cfg):g} s" if r.timed_out
               else f"failed: {_what(r)}")
        raise ConfigError(f"task.env: calling {getattr(make, '__name__', make)!r} with task.env_args={args} {why}")
    probe = r.value
    if isinstance(probe, Environment):
        _close_bounded([probe], _timeout(env_cfg))
        return _checked(_isolated(functools.partial(make, **args), env_cfg), "task.env", _timeout(env_cfg),
                        "max_turns" in args)
    if args:
        raise ConfigError(f"task.env_args={args}: a TRL environment_factory is called without arguments")
    return _checked(_isolated(functools.partial(FactoryEnvironment, make, env_cfg.max_turns, env_cfg.tool_timeout_s,
                                                error_prefix=getattr(env_cfg, "tool_error_prefix", None)),
                              env_cfg), "task.env", _timeout(env_cfg))


def _timeout(env_cfg) -> float:
    return getattr(env_cfg, "reset_timeout_s", 60.0)


def _isolated(factory: functools.partial, env_cfg) -> functools.partial:
    """``factory`` as ``env.step_isolation`` runs it: as it is (``thread``), or each environment made in a
    worker process of its own (``process``, :class:`mugrpo.rollout.envs.isolated.ProcessEnvironment`)."""
    if getattr(env_cfg, "step_isolation", "process") != "process":
        return factory
    if (why := portable_problem(factory)) is not None:
        _thread_fallback("env.step_isolation", f"the environment {why}")
        return factory
    return functools.partial(ProcessEnvironment, factory, getattr(env_cfg, "step_timeout_s", 30.0), _timeout(env_cfg))


def _isolation_line(factory: functools.partial, tools: tuple) -> str:
    if factory.func in (ENVIRONMENTS.get(name) for name in THREAD_BUILTINS):
        return ("steps in threads of the trainer's process (a built-in environment, mugrpo's own code: "
                "env.step_isolation does not apply)")
    if factory.func is ToolEnvironment and _tool_runner(factory) == "process":
        return ("tool calls in worker processes (env.tool_isolation=process); the tool environment, mugrpo's own, in "
                "the trainer's process")
    steps = "process" if factory.func is ProcessEnvironment else "thread"
    where = "a worker process per environment" if steps == "process" else "threads of the trainer's process"
    line = f"steps in {where} (env.step_isolation={steps})"
    if tools and steps == "process":
        line += "; its tool calls on threads in that worker, killed with it at env.step_timeout_s"
    elif tools:
        runner = _tool_runner(factory)
        line += f"; tool calls in {'worker processes' if runner == 'process' else 'threads'} " \
                f"(env.tool_isolation={runner})"
    return line


def _tool_runner(factory: functools.partial) -> str:
    inner = factory.args[0] if factory.func is ProcessEnvironment else factory
    runner = next((a for a in getattr(inner, "args", ()) if isinstance(a, CallRunner)), None)
    return runner.isolation if runner is not None else "thread"


def _checked(factory: functools.partial, key: str, timeout_s: float, max_turns_given: bool = False) -> CheckedFactory:
    """``factory`` once it has made (and closed) two environments with a valid ``max_turns`` and the
    same stop strings, with what the first was; ConfigError naming ``key`` if not
    (``task.env_args.max_turns`` when ``max_turns_given``: the value came from there). Each call into
    the environment's code (the two factory calls, the first's ``tools()``, the closes) is bounded by
    ``timeout_s``; a ``tools()`` that fails is the stage's to count (each item's is), so it is only noted."""
    runner, envs = CallRunner(1), []
    # A constructor that exits the process (os._exit) exits its worker (env.step_isolation=process), or
    # raises ProcessExit on the check's thread (thread): either way the error below names it; a crash in
    # native code under thread isolation takes this message with it.
    where = ("env.step_isolation=process" if factory.func is ProcessEnvironment else
             "env.tool_isolation=process" if _tool_runner(factory) == "process" else "env.step_isolation=thread")
    print(f"[mugrpo] start-up check: making two environments with {env_name(factory)} ({where})", file=sys.stderr,
          flush=True)
    try:
        for _ in range(2):
            try:
                envs.append(_make_checked(runner, factory, key, timeout_s))
            except NotPortable as exc:  # it pickled here but does not load in the worker
                _thread_fallback("env.step_isolation", f"the environment {env_name(factory)} does not load in a "
                                                       f"worker process ({exc})")
                factory = factory.args[0]
                envs.append(_make_checked(runner, factory, key, timeout_s))
        tools = runner.run([lambda: list(envs[0].tools())], timeout_s, name="mugrpo-env-check")[0]
    finally:
        _close_bounded(envs, timeout_s)
    first, second = envs
    name = getattr(first, "env_name", type(first).__name__).rsplit(".", 1)[-1]
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
    checked = CheckedFactory(factory.func, *factory.args, **factory.keywords)
    tool_names = tuple(getattr(t, "__name__", type(t).__name__) for t in tools.value or ())
    checked.summary = EnvSummary(getattr(first, "env_name", f"{type(first).__module__}.{type(first).__qualname__}"),
                                 tool_names, _tools_error(tools, name, timeout_s), turns, tuple(stops[0]),
                                 _isolation_line(factory, tool_names))
    return checked


def _make_checked(runner: CallRunner, factory: functools.partial, key: str, timeout_s: float) -> Environment:
    """One environment from ``factory``, made bounded; ConfigError naming ``key`` if the call raised or hung."""
    target = env_name(factory)
    r = runner.run([factory], timeout_s, name="mugrpo-env-check")[0]
    if r.timed_out:
        raise ConfigError(f"{key}: making the environment ({target}) at start ran past env.reset_timeout_s="
                          f"{timeout_s:g} s")
    if isinstance(r.exception, NotPortable):
        raise r.exception
    if r.exited is not None:  # os._exit or a crash: the code is what there is to say, a traceback is noise
        raise ConfigError(f"{key}: making the environment ({target}) at start ended its process (exit code "
                          f"{r.exited}: os._exit or a crash in native code); an environment's constructor must "
                          "return, or raise an exception to refuse") from None
    if isinstance(r.exception, (TypeError, ValueError)):  # most often arguments it does not take
        raise ConfigError(f"{key}: {r.exception}") from r.exception
    if r.error is not None:
        raise ConfigError(f"{key}: making the environment ({target}) at start failed: {_what(r)}\n{r.error}")
    return r.value


def _what(r) -> str:
    """A failed call in one line: the exception (or, for a refused call, the runner's reason)."""
    return f"{type(r.exception).__name__}: {r.exception}" if r.exception is not None else r.error.strip()


def _tools_error(r, name: str, timeout_s: float) -> Optional[str]:
    if r.timed_out:
        return f"{name}.tools() ran past env.reset_timeout_s={timeout_s:g} s"
    if r.error is not None:
        return f"{name}.tools() raised {_what(r)}"
    return None


def describe_env(summary: Optional[EnvSummary]) -> list[tuple[str, str]]:
    """(label, value) rows of what a checked factory makes (``factory.summary``): its name, tools, max
    turns and stop strings; [] for a single-turn run (None)."""
    if summary is None:
        return []
    tools = ", ".join(summary.tools) if summary.tools else "none"
    return [("environment", summary.name),
            ("environment tools", f"unknown: {summary.tools_error}" if summary.tools_error else tools),
            ("environment isolation", summary.isolation),
            ("environment max turns", str(summary.max_turns)),
            ("environment stop strings", ", ".join(repr(s) for s in summary.stop) if summary.stop else "none (EOS only)")]


def turn_budget_rows(summary: Optional[EnvSummary], tokenizer, max_new_tokens: int, env_cfg) -> list[tuple[str, str]]:
    """(label, value) rows of what one environment turn costs in template tokens (an empty observation
    rendered by the model's tokenizer, :func:`mugrpo.rollout.envs.render.env_turn_ids`) and how many
    policy turns ``rollout.max_new_tokens`` allows at the per-turn cap; [] for a single-turn run."""
    from mugrpo.rollout.envs.render import env_turn_ids

    if summary is None:
        return []
    role = "tool" if summary.tools else "user"
    turns = min(env_cfg.max_turns, summary.max_turns)
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


def format_rows(rows: list[tuple[str, str]]) -> str:
    """``rows`` as ``mugrpo plan`` prints them: labels padded to one width, a line each; "" for none."""
    if not rows:
        return ""
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


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
