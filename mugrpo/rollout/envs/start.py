"""Starting a stage's trajectories: G environments per item, each made and reset with its own seed,
and the prompt ids each group shares.

What :func:`mugrpo.rollout.multiturn.run_trajectories` takes (environments group-major, one
prompt per group) from what the trainer has (a factory, the stage's items, G, a seed). A group's
G trajectories share their prompt (the first turn samples G continuations of it), so an
environment's ``reset`` must give the same prompt for the same item whatever the seed; the seed
is for what the environment does later (e.g. a game's hidden state).

Every call into the environment's code here (the factory call, ``reset``, ``tools()``, and
``close`` of what was made when a group fails) runs on :class:`mugrpo.rollout.calls.CallRunner`,
each bounded by ``timeout_s`` (``env.reset_timeout_s``; a close by the same). An item whose
environment cannot be made or reset (an exception, a timeout, messages that are not chat
messages) fails: with a :class:`Skips` it is left out (its whole group: the others' environments are
closed) and reported in :attr:`Skips.failures` (and :attr:`Started.failures`); without one the
first failure stops with a :class:`mugrpo.errors.TaskError`. Every item failing stops, naming the
environment and the first error with its traceback, unless ``Skips.none_left_stops`` is False: then
nothing is started and the caller decides (evaluation decides over every mode and rank,
:mod:`mugrpo.evaluation.evaluate`). Two resets
of one item that give different prompts are the environment's design error and always stop. This
module knows nothing about engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mugrpo.errors import TaskError
from mugrpo.rollout.calls import CallRunner
from mugrpo.rollout.envs.base import EnvFactory, Environment
from mugrpo.rollout.envs.isolated import ProcessEnvironment
from mugrpo.rollout.envs.render import trajectory_prompt_ids

__all__ = ["start_trajectories", "reset_seed", "Started", "Skips", "env_name"]


def reset_seed(seed: int, item_index: int, member: int) -> int:
    """The seed of ``reset`` for member ``member`` of the group of the stage's ``item_index``-th item."""
    from mugrpo.seeds import derive

    return derive(seed, "env-reset", item_index, member)


@dataclass
class Started:
    """The groups that started: their item indices (into ``items``), prompt ids and environments."""

    kept: list[int] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    envs: list[Environment] = field(default_factory=list)
    """``len(kept) * G`` reset environments, group-major."""
    failures: list[str] = field(default_factory=list)
    """One per item left out: what failed, with its traceback."""


@dataclass
class Skips:
    """How items whose environment fails to start are skipped, and what failed."""

    failures: list[str] = field(default_factory=list)
    """One per item left out: what failed, with its traceback (appended to as items fail)."""
    none_left_stops: bool = True
    """Every item failing stops (a TaskError naming the environment and the first error); False:
    nothing is started and the caller decides."""


class _ItemFailed(Exception):
    pass


def start_trajectories(factory: EnvFactory, items: list, group_size: int, seed: int, tokenizer, task_cfg,
                       timeout_s: float = 60.0, skip: Optional[Skips] = None) -> Started:
    """G made and reset environments per item, and each group's prompt (see the module docstring)."""
    runner, out = CallRunner(1), Started()
    try:
        for i, item in enumerate(items):
            group: list[Environment] = []
            try:
                prompt = _start_group(runner, factory, item, [reset_seed(seed, i, g) for g in range(group_size)],
                                      group, (tokenizer, task_cfg, timeout_s))
            except _ItemFailed as exc:
                _close_quietly(runner, group, timeout_s)
                if skip is None:
                    raise TaskError(str(exc)) from None
                out.failures.append(str(exc))
                skip.failures.append(str(exc))
                continue
            except BaseException:
                _close_quietly(runner, group, timeout_s)
                raise
            out.kept.append(i)
            out.prompts.append(prompt)
            out.envs += group
    except BaseException:
        _close_quietly(runner, out.envs, timeout_s)
        raise
    if items and not out.kept and (skip is None or skip.none_left_stops):
        raise TaskError(f"every item of this stage failed to start its environment ({env_name(factory)}), so there "
                        f"is nothing to generate: {len(out.failures)} of {len(items)} failed. The first:\n"
                        f"{out.failures[0]}")
    return out


def _start_group(runner: CallRunner, factory: EnvFactory, item, seeds: list[int], group: list[Environment],
                 render: tuple) -> list[int]:
    """Make and reset the group's environments (appended to ``group`` as they are made, for the
    caller to close); the group's prompt ids. Raises :class:`_ItemFailed` saying what failed."""
    tokenizer, task_cfg, timeout_s = render
    where = f"on item {item.question[:60]!r}"
    messages = []
    for _ in seeds:  # all made, then all reset: the order of the calls as ever
        group.append(_guarded(runner, factory, timeout_s, f"making the environment ({env_name(factory)})", where))
    for env, s in zip(group, seeds):
        messages.append(_check_messages(env, _guarded(runner, lambda: env.reset(item, s), timeout_s,
                                                      f"{type(env).__name__}.reset", where)))
    if any(m != messages[0] for m in messages[1:]):
        raise TaskError(f"{type(group[0]).__name__}.reset gave different prompts for the same item "
                        f"({item.question[:60]!r}) under different seeds; the {len(seeds)} trajectories of "
                        "a group share their prompt: make reset's messages depend on the item only")
    first = group[0]
    tools = _guarded(runner, lambda: list(first.tools()), timeout_s, f"{type(first).__name__}.tools()", where)
    try:
        return trajectory_prompt_ids(tokenizer, messages[0], item, task_cfg, tools)
    except Exception as exc:  # noqa: BLE001 - the environment's messages or tools the template cannot render
        raise _ItemFailed(f"rendering {type(first).__name__}'s prompt {where} failed: {type(exc).__name__}: {exc}")


def _guarded(runner: CallRunner, call, timeout_s: float, what: str, where: str):
    """``call()``'s value, run bounded; :class:`_ItemFailed` naming ``what`` if it raised or hung."""
    r = runner.run([call], timeout_s, name="mugrpo-env-start")[0]
    if r.timed_out:
        raise _ItemFailed(f"{what} ran past env.reset_timeout_s={timeout_s:g} s {where}")
    if r.error is not None:
        exc = r.exception
        raise _ItemFailed(f"{what} raised {where}: {type(exc).__name__}: {exc}\n{r.error}")
    return r.value


def _check_messages(env: Environment, messages):
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise _ItemFailed(f"{type(env).__name__}.reset returned {messages!r:.120}; it must return None (the task's "
                          "prompt) or a non-empty list of {'role': str, 'content': str} messages")
    return messages


def env_name(factory) -> str:
    """The name of what ``factory`` makes (a class's or a function's), for messages; under process isolation
    the name of what the worker makes, not of the wrapper."""
    target = getattr(factory, "func", factory)  # a functools.partial
    if target is ProcessEnvironment:
        return env_name(factory.args[0])
    return getattr(target, "__qualname__", None) or type(target).__name__


def _close_quietly(runner: CallRunner, envs: list[Environment], timeout_s: float) -> None:
    """Close ``envs``, each bounded; failures ignored (already failing: the first error is the one to report)."""
    for env in envs:
        runner.run([env.close], timeout_s, name="mugrpo-env-close")
