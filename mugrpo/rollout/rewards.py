"""Reward functions: the built-in scorers, user functions in two signatures, and a weighted sum of them.

A reward is given (config ``task.rewards``, or ``reward_funcs`` of :func:`mugrpo.train`) as
- a built-in name: ``correctness`` (the task's own checker: the reasoning-gym generator's
  ``score_answer``, or math-verify for datasets), ``math_verify`` (math-verify against the row's
  answer, on any task), ``boxed_format`` (1 if the response has a ``\\boxed{...}`` answer, else 0);
- an import path ``module:function``;
- (from Python) the function itself.

A user function has one of two signatures, told apart by its parameter names:
- per response: ``f(completion: str, answer: str, item: dict) -> float`` (``item`` is the source row);
- batched, as TRL's reward functions: ``f(prompts, completions, **kwargs) -> list[float]``, called once
  per stage with every response; ``kwargs`` holds each of the rows' other columns as a list (``answer``
  always among them). A prompt given as chat messages comes with its completion as messages too
  (``[{"role": "assistant", "content": text}]``), as in TRL.

Scoring never raises (KeyboardInterrupt aside): a call that raises, runs past the time limit, or
gives a value that is not a finite number scores 0 and is counted, per function
(:class:`RewardStats`). The stage reward is the weighted sum; each function is logged on its own.

This module knows nothing about models, the loss or the engines.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import numbers
import os
import signal
import threading
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from mugrpo.errors import TaskError

if TYPE_CHECKING:
    import torch

BUILTIN_REWARDS = ("correctness", "math_verify", "boxed_format")
PYTHON_PREFIX = "python:"
"""How a reward passed as a Python function is written in a run's config.yaml: ``python:module.qualname``."""


class RewardError(TaskError):
    """A reward that cannot be used (bad name, import path or signature); the message says the fix."""


# ---------------------------------------------------------------------------------------------
# Time limit and values.


class RewardTimeout(Exception):
    pass


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn()``; raise RewardTimeout after ``timeout_s`` (SIGALRM; main thread only, else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn()

    def on_alarm(signum, frame):
        raise RewardTimeout(f"reward call exceeded {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_FLOAT32_MAX = 3.4028234663852886e38
"""float(torch.finfo(torch.float32).max), without importing torch (the config module imports this one)."""


def as_reward(value: Any) -> Optional[float]:
    """``value`` as a float that is finite once stored as float32 (rewards are), else None.

    1e39 is a finite float64 but inf in float32, and an inf reward turns every advantage of its
    group into NaN, so it is as invalid as NaN itself."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        reward = float(value)
    except (OverflowError, ValueError):  # e.g. an int beyond float64
        return None
    return reward if math.isfinite(reward) and abs(reward) <= _FLOAT32_MAX else None


# ---------------------------------------------------------------------------------------------
# Reward functions.


@dataclass
class RewardFn:
    name: str
    fn: Callable
    weight: float = 1.0
    batched: bool = False
    """TRL-style ``f(prompts, completions, **kwargs) -> list``; else ``f(completion, answer, item)``."""
    builtin: bool = False
    accepts: Optional[frozenset] = None
    """For a batched function without ``**kwargs``: the keyword names it takes (others are not passed)."""


@dataclass
class RewardStats:
    sum: float = 0.0
    num_errors: int = 0
    num_timeouts: int = 0
    num_invalid: int = 0


@dataclass
class ScoreStats:
    num_scored: int = 0
    """Responses scored (each by every reward function)."""
    num_unparsable: int = 0
    """No ``\\boxed{}`` answer found (scored 0 by the built-in scorers)."""
    first_error: Optional[str] = None
    per_reward: dict[str, RewardStats] = field(default_factory=dict)

    @property
    def num_errors(self) -> int:
        return sum(s.num_errors for s in self.per_reward.values())

    @property
    def num_timeouts(self) -> int:
        return sum(s.num_timeouts for s in self.per_reward.values())

    @property
    def num_invalid(self) -> int:
        """Scorer returned None, NaN, inf, a number beyond float32's range or a non-number."""
        return sum(s.num_invalid for s in self.per_reward.values())


def function_label(fn: Callable) -> str:
    """``python:module.qualname`` for a Python function (how config.yaml records it)."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{PYTHON_PREFIX}{module}.{name}"


def default_name(spec: Any) -> str:
    if callable(spec):
        return getattr(spec, "__name__", None) or type(spec).__name__
    spec = str(spec)
    if spec.startswith(PYTHON_PREFIX):
        return spec.rsplit(".", 1)[-1]
    return spec.rpartition(":")[2] if ":" in spec else spec


def make_reward(spec: Any, weight: float, name: Optional[str], builtins: dict[str, Callable]) -> RewardFn:
    """One reward from its spec (built-in name, ``module:function``, or a callable)."""
    name = name or default_name(spec)
    if callable(spec):
        return _user_reward(name, spec, weight, repr(name))
    if not isinstance(spec, str):
        raise RewardError(f"reward {name!r}: {spec!r} is neither a built-in name ({', '.join(BUILTIN_REWARDS)}), "
                          "a 'module:function' path nor a Python function")
    if spec in builtins:
        return RewardFn(name, builtins[spec], weight, builtin=True)
    if spec.startswith(PYTHON_PREFIX):
        raise RewardError(f"reward {name!r} was a Python function ({spec[len(PYTHON_PREFIX):]}) passed to "
                          "mugrpo.train; a config file cannot hold it. Resume this run from Python, passing the "
                          "same function: mugrpo.train(run_dir=..., reward_funcs=[...], resume=True); evaluate "
                          "its model with the task's correctness: mugrpo eval --model RUN_DIR/final_model")
    if ":" not in spec:
        raise RewardError(f"reward {spec!r} is not a built-in ({', '.join(BUILTIN_REWARDS)}) nor a "
                          "'module:function' import path")
    return _user_reward(name, load_function(spec, "reward"), weight, repr(spec))


def _user_reward(name: str, fn: Callable, weight: float, shown: str) -> RewardFn:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature: take it as per-response
        return RewardFn(name, fn, weight)
    names = list(params)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if "prompts" in names and "completions" in names:
        keywords = None if var_kw else frozenset(n for n in names if n not in ("prompts", "completions"))
        return RewardFn(name, fn, weight, batched=True, accepts=keywords)
    if len(positional) >= 3 and len(required) <= 3 or any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        return RewardFn(name, fn, weight)
    raise RewardError(f"reward function {shown} has the signature {name}{inspect.signature(fn)}, which mugrpo "
                      "cannot call. Write it as f(prompts, completions, **kwargs) -> list[float] (batched, as "
                      "TRL's reward functions) or f(completion, answer, item) -> float (one response)")


def load_function(spec: str, what: str) -> Callable:
    """The function named by ``module:function``; RewardError naming the real cause when it cannot load."""
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):  # not found itself
            raise RewardError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc}); "
                              "make sure it is on PYTHONPATH") from exc
        raise RewardError(_import_failure(what, spec, module_name, exc)) from exc
    except Exception as exc:  # noqa: BLE001 - the module's own code failed (SyntaxError, a raise at import)
        raise RewardError(_import_failure(what, spec, module_name, exc)) from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardError(f"{what} {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def _import_failure(what: str, spec: str, module_name: str, exc: BaseException) -> str:
    """The message for a module found but failing inside its own import: the real cause and where."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{f.filename}:{f.lineno}" for f in reversed(frames) if "importlib" not in f.filename), None)
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}:{exc.lineno}"
    return (f"{what} {spec!r}: importing module {module_name!r} failed inside the module: "
            f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
            + ". Fix the module or install what it imports")


# ---------------------------------------------------------------------------------------------
# Scoring.


def score(rewards: list[RewardFn], completions: list[str], items: list, timeout_s: float,
          extract: Callable[[str], Optional[str]]) -> tuple["torch.Tensor", ScoreStats]:
    """The weighted sum of every reward for each completion, and what happened, per function."""
    import torch

    stats = ScoreStats(num_scored=len(completions))
    if any(r.builtin for r in rewards):
        stats.num_unparsable = sum(extract(text) is None for text in completions)
    total = torch.zeros(len(completions), dtype=torch.float64)
    for reward in rewards:
        own = stats.per_reward.setdefault(reward.name, RewardStats())
        values = (_score_batched if reward.batched else _score_each)(reward, completions, items, timeout_s, own, stats)
        own.sum += float(sum(values))
        total += reward.weight * torch.tensor(values, dtype=torch.float64)
    return total.float(), stats


_FAILED = object()


class RewardExit(Exception):
    """A reward called ``os._exit``, which would have ended the whole run without a message."""


@contextlib.contextmanager
def _process_exit_refused():
    """While a reward runs, ``os._exit`` raises :class:`RewardExit` instead of killing the process.

    ``os._exit`` skips every ``finally`` and handler, so without this a reward that calls it ends the
    run silently (nothing is lost: the last checkpoint resumes). Only calls through the ``os`` module
    are caught: a reward that bound ``_exit`` before (``from os import _exit``), a C-level ``exit()``
    or a crash still ends the process (docs/RELIABILITY.md). A forked child (e.g. a multiprocessing
    worker the reward starts) must still be able to exit, so another pid gets the real function.
    """
    real, owner = os._exit, os.getpid()

    def refuse(code: int) -> None:
        if os.getpid() != owner:
            real(code)
        raise RewardExit(f"the reward called os._exit({code}), which would end the run without a message; "
                         "the call scored 0. Return a number instead (or raise an exception)")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def _guarded(call: Callable[[], Any], timeout_s: float, own: RewardStats, stats: ScoreStats, count: int) -> Any:
    """``call()`` with the time limit; ``_FAILED`` (``count`` errors or timeouts counted) if it fails."""
    try:
        with _process_exit_refused():
            return call_with_timeout(call, timeout_s)
    except RewardTimeout:
        own.num_timeouts += count
    except KeyboardInterrupt:  # Ctrl-C must still stop the run
        raise
    except BaseException:  # noqa: BLE001 - a user scorer may raise anything, sys.exit() included
        own.num_errors += count
        stats.first_error = stats.first_error or traceback.format_exc()
    return _FAILED


def _valid(value: Any, own: RewardStats) -> float:
    if value is _FAILED:
        return 0.0
    reward = as_reward(value)
    if reward is None:
        own.num_invalid += 1
        return 0.0
    return reward


def _score_each(reward: RewardFn, completions, items, timeout_s, own: RewardStats, stats: ScoreStats) -> list[float]:
    values = []
    for text, item in zip(completions, items):
        args = (text, item) if reward.builtin else (text, item.answer, item.entry)
        values.append(_valid(_guarded(lambda: reward.fn(*args), timeout_s, own, stats, 1), own))
    return values


def _score_batched(reward: RewardFn, completions, items, timeout_s, own: RewardStats, stats: ScoreStats) -> list[float]:
    n = len(completions)
    prompts = [item.prompt for item in items]
    shown = [[{"role": "assistant", "content": text}] if isinstance(item.prompt, list) else text
             for text, item in zip(completions, items)]
    columns = {"answer": [item.answer for item in items]}
    for key in dict.fromkeys(k for item in items for k in item.entry):
        if key not in ("prompt", "_split"):
            columns.setdefault(key, [item.entry.get(key) for item in items])
    if reward.accepts is not None:
        columns = {k: v for k, v in columns.items() if k in reward.accepts}
    out = _guarded(lambda: reward.fn(prompts=prompts, completions=shown, **columns), timeout_s * max(n, 1), own,
                   stats, n)
    if out is _FAILED:
        return [0.0] * n
    try:
        values = list(out)
    except TypeError:
        values = None
    if values is None or len(values) != n:
        own.num_errors += n
        stats.first_error = stats.first_error or (
            f"reward {reward.name!r} returned {type(out).__name__}"
            + (f" of length {len(values)}" if values is not None else "")
            + f"; a batched reward must return a list of {n} numbers, one per completion (a None or NaN among "
            "them scores 0 and is counted in num_invalid)")
        return [0.0] * n
    return [_valid(v, own) for v in values]
