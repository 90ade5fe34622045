"""Tools the model calls: the text protocol and the tool environments (calls run on :mod:`mugrpo.rollout.calls`).

The protocol is Hermes/Qwen's, so one parser serves every model: the model writes
``<tool_call>{"name": "fn", "arguments": {...}}</tool_call>`` (any number of calls, anywhere in
its turn); each result goes back as a ``{"role": "tool", "name": "fn", "content": ...}`` message.
Tools are described by :func:`transformers.utils.get_json_schema` (type hints and a Google-style
docstring, as TRL requires). A chat template that renders tools itself gets the schemas through
``tools=``; for one that does not (SmolLM2, the tiny test model), :func:`protocol_text` is the
system text that teaches the protocol (:mod:`.render` decides which, and renders the tokens).

Nothing a model writes can crash a run: an unknown tool, a call that is not JSON, arguments that
do not bind to the signature, a tool that raises, and a tool that runs past its timeout all come
back to the model as ``{"error": "..."}`` and are counted in :attr:`StepResult.metadata` (a tool that
ends its process, ``os._exit`` or a crash, is not the model's doing: the step raises
:class:`~mugrpo.rollout.calls.ProcessExit` naming the tool, and the loop ends that trajectory as
``env_error``):

- ``tool_calls``: calls attempted (well-formed or not);
- ``tool_errors``: calls answered with an error, all causes together; broken down into
  ``tool_unknown`` (no such tool), ``tool_bad_args`` (not JSON, not an object, or arguments that do
  not bind), ``tool_exceptions`` (the tool raised, or was refused: too many hung calls) and
  ``tool_timeouts`` (past ``timeout_s``), and ``tool_reported_errors``: with ``error_prefix``
  (``env.tool_error_prefix``, e.g. ``"Error:"``), a string result starting with it (the tool's own
  error message, as TRL tools often return; the model reads it unchanged). Without it only a raise,
  a timeout or a bad call is a failure: a returned error string counts as a success.

Calls run on the one bounded, timed runner of :mod:`mugrpo.rollout.calls` (the environment steps
run on it too): at most 16 at a time across all tool environments of the process
(:data:`~mugrpo.rollout.calls.TOOL_RUNNER`, unless an environment is given its own ``runner``), so
slow tools of different trajectories overlap. A call's timeout runs from its start; a timed-out
call gives its slot back, and its daemon thread runs on unobserved (it never blocks the exit; the
hung threads are capped). Under ``env.tool_isolation=process`` (a run's default for ``task.tools``)
the calls run in worker processes, killed at their timeout
(:func:`~mugrpo.rollout.calls.process_tool_runner`): the tools must then pickle (module-level
functions; :mod:`.build` falls back to threads, with a warning, for tools that do not).

This module knows nothing about tokens (that is :mod:`.render`) nor about the rollout loop.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mugrpo.rollout.calls import TOOL_RUNNER, CallRunner, ProcessExit
from mugrpo.rollout.envs.base import Environment, StepResult

__all__ = ["ToolCall", "parse_tool_calls", "tool_schemas", "protocol_text", "ToolEnvironment",
           "FactoryEnvironment", "COUNT_KEYS"]

COUNT_KEYS = ("tool_calls", "tool_errors", "tool_unknown", "tool_bad_args", "tool_exceptions", "tool_timeouts",
              "tool_reported_errors")
"""The counts each tool step reports in its metadata (all present, zeros included)."""

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_OPEN = "<tool_call>"


# ---------------------------------------------------------------------------------------------
# The protocol: parsing and describing.


@dataclass
class ToolCall:
    """One parsed call: a name and arguments, or why it could not be parsed (``error``)."""

    name: Optional[str]
    arguments: dict
    error: Optional[str] = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text``, in order; a block that does not parse is a
    call with ``error`` set. An unclosed ``<tool_call>`` at the end (the turn was cut off) counts as
    a malformed call, since the model did try to call."""
    calls = [_parse_one(body.strip()) for body in _CALL.findall(text)]
    tail = _CALL.sub("", text)
    if _OPEN in tail:
        calls.append(ToolCall(None, {}, "unclosed <tool_call>: end the call with </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({exc.msg} at column {exc.colno}); write "
                                  '{"name": ..., "arguments": {...}}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(obj["name"], {}, "the arguments are a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, f"the arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(obj["name"], arguments)


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """The JSON schema of each tool (``{"type": "function", "function": {...}}``), as TRL builds them.

    Raises ValueError naming the tool when it lacks type hints or a docstring with an ``Args:``
    section (what :func:`transformers.utils.get_json_schema` needs)."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in tools:
        try:
            schemas.append(get_json_schema(tool))
        except Exception as exc:  # noqa: BLE001 - transformers raises its own parsing exceptions
            name = getattr(tool, "__name__", repr(tool))
            raise ValueError(f"tool {name!r}: {exc}. A tool needs a type hint on every argument and a Google-style "
                             "docstring with a summary line and an 'Args:' section describing each argument") from exc
    return schemas


def protocol_text(schemas: list[dict]) -> str:
    """The system text that teaches the protocol, worded as Qwen's template words it."""
    listing = "\n".join(json.dumps(s) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
            "Each result comes back inside <tool_response></tool_response> tags. When you have the answer, "
            "reply without a tool call.")


# ---------------------------------------------------------------------------------------------
# The environments.


def _result_text(value: Any) -> str:
    """What a tool returned, as the text the model reads (JSON for containers, else ``str``)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value) if isinstance(value, (dict, list, tuple)) else str(value)
    except (TypeError, ValueError):
        return str(value)


def _error(message: str) -> str:
    return json.dumps({"error": message})


class ToolEnvironment(Environment):
    """TRL's ``tools=``: a policy turn with ``<tool_call>`` blocks gets the results back; a turn
    without one is the final answer and ends the trajectory (reward 0 here: the task's rewards
    score that final turn). ``max_turns`` counts policy turns, the final answer included; the
    rollout loop enforces it."""

    stop = ("</tool_call>",)

    def __init__(self, tools: list[Callable], max_turns: int = 4, timeout_s: float = 10.0,
                 runner: Optional[CallRunner] = None, error_prefix: Optional[str] = None):
        """``error_prefix``: a string result starting with it is a failed call (``tool_reported_errors``)."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        names = [getattr(t, "__name__", None) for t in tools]
        if None in names or len(set(names)) < len(names):
            raise ValueError(f"tools must be named functions with distinct names, got {names}")
        self._tools = list(tools)
        self._by_name = dict(zip(names, tools))
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.runner = runner or TOOL_RUNNER
        self.error_prefix = error_prefix

    def tools(self) -> list[Callable]:
        return list(self._tools)

    def step(self, action: str) -> StepResult:
        # Not done at the last allowed turn even with a call: the rollout loop stops there and
        # counts it as "turn_limit", which "done" would hide.
        calls = parse_tool_calls(action)
        if not calls:
            return StepResult([], 0.0, True, self._zero_counts())
        contents, counts = self.call_tools(calls)
        observations = [{"role": "tool", "name": c.name or "unknown", "content": text}
                        for c, text in zip(calls, contents)]
        return StepResult(observations, 0.0, False, counts)

    def call_tools(self, calls: list[ToolCall]) -> tuple[list[str], dict]:
        """The text answering each call, and the counts (:data:`COUNT_KEYS`)."""
        counts = self._zero_counts()
        counts["tool_calls"] = len(calls)
        contents: list[Optional[str]] = [None] * len(calls)
        runnable, failed = [], set()
        for i, call in enumerate(calls):
            problem = self._check(call)
            if problem is not None:
                counts[problem[0]] += 1
                contents[i] = _error(problem[1])
                failed.add(i)
            else:
                runnable.append(i)
        fns = [self._by_name[calls[i].name] for i in runnable]
        outcomes = self.runner.run([_bound(fn, calls[i].arguments) for fn, i in zip(fns, runnable)], self.timeout_s,
                                   name="mugrpo-tool")
        for i, outcome in zip(runnable, outcomes):
            if outcome.exited is not None:  # not the model's doing: the trajectory ends (env_error), counted
                raise ProcessExit(f"tool {calls[i].name!r} ended its process (exit code {outcome.exited}): "
                                  f"{outcome.exception}", outcome.exited)
            if outcome.ok:
                contents[i] = _result_text(outcome.value)
                if self.error_prefix and isinstance(outcome.value, str) and outcome.value.startswith(self.error_prefix):
                    counts["tool_reported_errors"] += 1  # the tool's own error string, opted in to as a failure
                    failed.add(i)
                continue
            failed.add(i)
            if outcome.timed_out:
                counts["tool_timeouts"] += 1
                contents[i] = _error(f"tool {calls[i].name!r} did not return within {self.timeout_s:g} s")
                _warn_timeout(calls[i].name, self.timeout_s, self.runner.isolation)
            else:
                counts["tool_exceptions"] += 1
                exc = outcome.exception
                contents[i] = _error(f"{type(exc).__name__}: {exc}")
        counts["tool_errors"] = sum(counts[k] for k in ("tool_unknown", "tool_bad_args", "tool_exceptions",
                                                        "tool_timeouts", "tool_reported_errors"))
        for i, call in enumerate(calls):  # per tool (a call to an unknown name counts in the totals only)
            if call.name in self._by_name:
                counts[f"tool_calls/{call.name}"] += 1
                counts[f"tool_errors/{call.name}"] += i in failed
        return contents, counts

    def _zero_counts(self) -> dict:
        """:data:`COUNT_KEYS` and ``tool_calls/<name>`` / ``tool_errors/<name>`` of every tool, all 0."""
        return {**dict.fromkeys(COUNT_KEYS, 0),
                **{f"{key}/{name}": 0 for name in self._by_name for key in ("tool_calls", "tool_errors")}}

    def _check(self, call: ToolCall) -> Optional[tuple[str, str]]:
        """(count key, message) when ``call`` cannot run, else None."""
        if call.error is not None:
            return ("tool_unknown" if call.name is not None and call.name not in self._by_name
                    else "tool_bad_args"), call.error
        if call.name not in self._by_name:
            return "tool_unknown", f"unknown tool {call.name!r}; the tools are {sorted(self._by_name)}"
        try:
            inspect.signature(self._by_name[call.name]).bind(**call.arguments)
        except TypeError as exc:
            return "tool_bad_args", f"tool {call.name!r}: {exc}"
        return None


_warned_timeout: set[str] = set()


def _warn_timeout(name: str, timeout_s: float, isolation: str) -> None:
    """Once per tool and process: a call ran past its timeout (and, under thread isolation, runs on)."""
    if name in _warned_timeout:
        return
    _warned_timeout.add(name)
    if isolation == "process":
        print(f"[mugrpo] warning: tool {name!r} ran past env.tool_timeout_s={timeout_s:g} s: its worker process was "
              "killed, the call answered with an error and counted in env/tool_timeouts; the run goes on",
              file=sys.stderr, flush=True)
        return
    print(f"[mugrpo] warning: tool {name!r} ran past env.tool_timeout_s={timeout_s:g} s under env.tool_isolation="
          "thread: the call was answered with an error, but its thread cannot be killed and runs on (one that holds "
          "the GIL, e.g. a catastrophic regex, stalls the whole run). Set env.tool_isolation=process to have such "
          "calls killed at their timeout (the tools must pickle; docs/ENVIRONMENTS.md)", file=sys.stderr, flush=True)


class _Bound:
    """A tool with its arguments, an ``async def`` tool's coroutine run to its end on the call's own
    thread (or worker process: a class, not a closure, so it pickles when the tool does)."""

    __slots__ = ("fn", "arguments")

    def __init__(self, fn: Callable, arguments: dict):
        self.fn, self.arguments = fn, arguments

    def __call__(self) -> Any:
        value = self.fn(**self.arguments)
        return asyncio.run(value) if inspect.iscoroutine(value) else value


def _bound(fn: Callable, arguments: dict) -> Callable[[], Any]:
    return _Bound(fn, arguments)


class FactoryEnvironment(ToolEnvironment):
    """A TRL ``environment_factory`` object, unchanged: its public methods are the tools,
    ``reset(**row)`` starts an episode (a returned string is appended to the last user message, as
    TRL does), and its optional ``get_reward()`` is the environment reward.

    The reward of each step is the change of ``get_reward()`` since the previous step, so the
    trajectory's reward (the sum over its steps) is the last value of ``get_reward()`` wherever the
    trajectory stops: at the final answer, at the turn limit, or at the token budget."""

    def __init__(self, factory: Callable[[], Any], max_turns: int = 4, timeout_s: float = 10.0,
                 runner: Optional[CallRunner] = None, error_prefix: Optional[str] = None):
        self.obj = factory()
        if not callable(getattr(self.obj, "reset", None)):
            raise ValueError(f"environment_factory made a {type(self.obj).__name__} without a reset(**row) method")
        methods = [getattr(self.obj, name) for name in dir(self.obj)
                   if not name.startswith("_") and name not in ("reset", "get_reward")
                   and callable(getattr(self.obj, name))]
        super().__init__(methods, max_turns, timeout_s, runner, error_prefix)
        self._reward_so_far = 0.0

    def reset(self, item, seed: int) -> Optional[list[dict]]:
        text = self.obj.reset(**item.entry)
        if not text:
            return None
        messages = [dict(m) for m in item.messages] if item.messages else [{"role": "user", "content": item.question}]
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] = f"{messages[last_user]['content']}{text}"
        return messages

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        get_reward = getattr(self.obj, "get_reward", None)
        if callable(get_reward):
            value = get_reward()
            total = float(asyncio.run(value) if inspect.iscoroutine(value) else value)
            result.reward, self._reward_so_far = total - self._reward_so_far, total
        return result
