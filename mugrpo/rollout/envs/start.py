"""Starting a stage's trajectories: G environments per item, each reset with its own seed, and the
prompt ids each group shares.

What :func:`mugrpo.rollout.multiturn.run_trajectories` takes (environments group-major, one
prompt per group) from what the trainer has (a factory, the stage's items, G, a seed). A group's
G trajectories share their prompt (the first turn samples G continuations of it), so an
environment's ``reset`` must give the same prompt for the same item whatever the seed; the seed
is for what the environment does later (e.g. a game's hidden state).

A ``reset`` that raises or returns something that is not chat messages stops the run with a
:class:`mugrpo.errors.TaskError` naming the environment and the item: it happens before the stage
generates anything, and resume restarts the stage. This module knows nothing about engines.
"""

from __future__ import annotations

from mugrpo.errors import TaskError
from mugrpo.rollout.envs.base import EnvFactory, Environment
from mugrpo.rollout.envs.render import trajectory_prompt_ids

__all__ = ["start_trajectories", "reset_seed"]


def reset_seed(seed: int, item_index: int, member: int) -> int:
    """The seed of ``reset`` for member ``member`` of the group of the stage's ``item_index``-th item."""
    from mugrpo.seeds import derive

    return derive(seed, "env-reset", item_index, member)


def start_trajectories(factory: EnvFactory, items: list, group_size: int, seed: int, tokenizer,
                       task_cfg) -> tuple[list[list[int]], list[Environment]]:
    """(one prompt's ids per item, ``len(items) * group_size`` reset environments, group-major)."""
    prompts, envs = [], []
    try:
        for i, item in enumerate(items):
            group = [factory() for _ in range(group_size)]
            envs += group
            messages = [_reset(env, item, reset_seed(seed, i, g)) for g, env in enumerate(group)]
            if any(m != messages[0] for m in messages[1:]):
                raise TaskError(f"{type(group[0]).__name__}.reset gave different prompts for the same item "
                                f"({item.question[:60]!r}) under different seeds; the {group_size} trajectories of "
                                "a group share their prompt: make reset's messages depend on the item only")
            prompts.append(trajectory_prompt_ids(tokenizer, messages[0], item, task_cfg, group[0].tools()))
    except BaseException:
        for env in envs:
            _close_quietly(env)
        raise
    return prompts, envs


def _reset(env: Environment, item, seed: int):
    try:
        messages = env.reset(item, seed)
    except Exception as exc:  # noqa: BLE001 - user code: stop with its message, before the stage runs
        raise TaskError(f"{type(env).__name__}.reset raised on item {item.question[:60]!r}: "
                        f"{type(exc).__name__}: {exc}") from exc
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise TaskError(f"{type(env).__name__}.reset returned {messages!r:.120}; it must return None (the task's "
                        "prompt) or a non-empty list of {'role': str, 'content': str} messages")
    return messages


def _close_quietly(env: Environment) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - already failing: the first error is the one to report
        pass
