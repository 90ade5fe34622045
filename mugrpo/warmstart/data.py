"""Demonstrations for a supervised warm start: loaded, normalised and checked, one row at a time.

Sources: a ``datasets.Dataset``, a list of dicts, or a ``.jsonl`` / ``.json`` / ``.parquet`` file.
Row formats (TRL's):

- **conversational**: ``messages``, a list of ``{"role", "content"}`` with roles ``system`` (first
  message only), ``user``, ``assistant`` and ``tool``. An assistant message may carry ``tool_calls``
  in the OpenAI/TRL shape ``{"type": "function", "function": {"name": ..., "arguments": ...}}``
  (arguments a dict or a JSON string); a ``tool`` message is a tool's reply (its ``name`` defaults
  to the call it answers, in order).
- **prompt/completion**: ``prompt`` and ``completion``, each a string or a list of messages. A
  string prompt is the question of a user message (with ``task_cfg``: rendered as the RL task
  renders a question, instruction, few-shot turns and system prompt included); a string completion
  is one assistant message.
- ``tools`` (optional column): the tools' JSON schemas (dicts or JSON strings, or the whole list as
  one JSON string); from Python, callables too. Without the column, the ``tools`` given to
  :func:`load_demonstrations` apply.
- ``train`` (optional, on an assistant message, :data:`TRAIN_KEY`): ``false`` leaves that turn out
  of the loss (e.g. a wrong attempt kept as context). Other messages are never trained on (they are
  not the policy's tokens), so ``train: true`` there is refused.

Every row becomes a :class:`Demonstration`: the prompt (the messages before the first assistant
message), then each policy turn, the text the model writes (its content, then its tool call in the
Hermes protocol, :func:`tool_call_text`) with the environment messages that follow it. Messages
after the last assistant message are dropped: there is nothing after them to train on.

The rollout loop stops a policy turn at the first ``</tool_call>`` (``ToolEnvironment.stop``), so a
turn can make ONE call, as its last words; a message with two calls, or text after its call, could
never be sampled and is refused (write one assistant message per call, each followed by its reply,
or load with ``split_calls=True``: :func:`split_parallel_calls` does that rewrite).

Every problem is a :class:`DemonstrationError` naming the row and what is wrong. This module knows
nothing about tokens (:mod:`mugrpo.warmstart.render`) nor about training.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from mugrpo.errors import TaskError
from mugrpo.rollout.envs.tools import parse_tool_calls

__all__ = ["TRAIN_KEY", "ROLES", "DemonstrationError", "PolicyTurn", "Demonstration", "load_demonstrations",
           "read_rows", "parse_row", "split_parallel_calls", "tool_call_text", "tool_name"]

TRAIN_KEY = "train"
"""The per-message loss override: ``"train": false`` on an assistant message leaves it out of the loss."""
ROLES = ("system", "user", "assistant", "tool")


class DemonstrationError(TaskError):
    """A demonstration that cannot be used; the message names its row and what is wrong."""


@dataclass(frozen=True)
class PolicyTurn:
    text: str
    """What the model writes in this turn: the content, then its tool call (Hermes protocol)."""
    calls_tool: bool
    """The turn ends with a ``</tool_call>``: at rollout it stops there, without sampling EOS."""
    train: bool = True
    env: list[dict] = field(default_factory=list)
    """The messages after this turn up to the next assistant message: the environment's turn."""


@dataclass(frozen=True)
class Demonstration:
    index: int
    """The row's position in its source."""
    prompt: list[dict]
    turns: list[PolicyTurn]
    tools: list = field(default_factory=list)
    """Callables or JSON schemas (:func:`mugrpo.rollout.envs.render.prompt_ids` takes both)."""


def tool_call_text(name: str, arguments: dict) -> str:
    """One call as the model writes it for the rollout loop to parse (Qwen's ``<tool_call>`` block)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def tool_name(tool) -> Optional[str]:
    """The name of a tool given as a callable or as a JSON schema."""
    if isinstance(tool, dict):
        return (tool.get("function") or {}).get("name") if isinstance(tool.get("function"), dict) else None
    return getattr(tool, "__name__", None)


def load_demonstrations(source, tools: Iterable = (), task_cfg=None, split_calls: bool = False
                        ) -> list[Demonstration]:
    """Every row of ``source`` as a :class:`Demonstration`; :class:`DemonstrationError` on the first bad
    row, or when there is none. ``tools`` apply to rows without a ``tools`` column; ``task_cfg``
    renders string prompts as the RL task does (:func:`mugrpo.rollout.tasks.render_messages`);
    ``split_calls`` rewrites parallel calls one per turn (:func:`split_parallel_calls`) instead of
    refusing them."""
    rows = read_rows(source)
    if not rows:
        raise DemonstrationError(f"no demonstrations in {_describe(source)}: the dataset is empty")
    return [parse_row(row, i, list(tools), task_cfg, split_calls) for i, row in enumerate(rows)]


def read_rows(source) -> list[dict]:
    """The rows of a ``datasets.Dataset``, a list of dicts, or a .jsonl / .json / .parquet file."""
    if isinstance(source, (str, Path)):
        return _read_file(Path(source))
    try:
        rows = list(source)
    except TypeError as exc:
        raise DemonstrationError(f"demonstrations must be a datasets.Dataset, a list of dicts or a file path, "
                                 f"not {type(source).__name__}") from exc
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DemonstrationError(f"demonstration row {i} is a {type(row).__name__}, not a dict; each row is a "
                                     'dict such as {"messages": [...]} or {"prompt": ..., "completion": ...}')
    return [dict(row) for row in rows]


def _read_file(path: Path) -> list[dict]:
    if not path.exists():
        raise DemonstrationError(f"demonstration file {path} does not exist")
    if not path.is_file():
        raise DemonstrationError(f"demonstration file {path} is not a regular file (a folder, a device or a pipe); "
                                 "give a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()  # demos.JSONL is a jsonl file too, as the RL dataset loader reads it
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix not in (".json", ".jsonl"):
        raise DemonstrationError(f"{path}: demonstrations are read from .jsonl, .json or .parquet files")
    text = path.read_text()
    if suffix == ".json":
        rows = _json(text, f"{path}", "")
        if not isinstance(rows, list):
            raise DemonstrationError(f"{path}: a .json file of demonstrations must hold a list of rows")
        return rows
    return [_json(line, f"{path}, line {n}", "") for n, line in enumerate(text.splitlines(), start=1)
            if line.strip()]


def _describe(source) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"the given {type(source).__name__}"


# ---------------------------------------------------------------------------------------------
# One row.


def parse_row(row: Any, index: int, tools: list, task_cfg=None, split_calls: bool = False) -> Demonstration:
    """Row ``index`` as a :class:`Demonstration` (see the module docstring for the formats)."""
    where = f"demonstration row {index}"
    if not isinstance(row, dict):
        raise DemonstrationError(f"{where} is a {type(row).__name__}, not a dict")
    messages = _row_messages(row, where, task_cfg)
    for j, m in enumerate(messages):
        if isinstance(m, dict):
            _calls_of(m, j, where)
    if split_calls:
        try:
            messages = split_parallel_calls(messages)
        except ValueError as exc:
            raise DemonstrationError(f"{where}: {exc}") from exc
    row_tools = _row_tools(row.get("tools"), where)
    tools = row_tools if row_tools is not None else tools
    names = [tool_name(t) for t in tools]
    for name in names:
        if not isinstance(name, str) or not name:
            raise DemonstrationError(f"{where}: a tool is neither a named function nor a JSON schema "
                                     '{"type": "function", "function": {"name": ...}} with a name that is a '
                                     f"non-empty string (its name: {name!r})")
    by_name = dict(zip(names, tools))
    roles = [_role(m, j, where) for j, m in enumerate(messages)]
    first = next((j for j, role in enumerate(roles) if role == "assistant"), None)
    if first is None:
        raise DemonstrationError(f"{where} has no assistant message: nothing to train on")
    if first == 0:
        raise DemonstrationError(f"{where} starts with an assistant message: the prompt (the messages before "
                                 "the first assistant message) is empty")
    prompt = [_plain_message(m, j, where) for j, m in enumerate(messages[:first])]
    tool_in_prompt = next((j for j, role in enumerate(roles[:first]) if role == "tool"), None)
    if tool_in_prompt is not None:
        raise DemonstrationError(f"{where}: message {tool_in_prompt} is a tool reply in the prompt (before the first "
                                 "assistant message), where no call was made; a tool reply follows the assistant "
                                 "message that calls the tool")
    turns: list[PolicyTurn] = []
    pending: list[str] = []  # names of the calls still waiting for a tool reply
    caller = first  # the assistant message whose calls are pending
    for j in range(first, len(messages)):
        m = messages[j]
        if roles[j] == "assistant":
            if j > first and roles[j - 1] == "assistant":
                raise DemonstrationError(f"{where}: messages {j - 1} and {j} are both assistant messages; a policy "
                                         "turn is followed by the environment's turn (merge them into one)")
            if pending:
                raise DemonstrationError(f"{where}: message {caller} calls {pending[0]!r}, but no tool reply answers "
                                         f"it before message {j}; at rollout every call is answered by a tool "
                                         "message before the next assistant turn")
            turn, pending = _policy_turn(m, j, where, by_name)
            turns.append(turn)
            caller = j
        else:
            message = _plain_message(m, j, where)
            if message["role"] == "tool":
                if not pending:
                    why = "has no call left unanswered" if turns[-1].calls_tool else "calls no tool"
                    raise DemonstrationError(
                        f"{where}: message {j} is a tool reply that answers no call (message {caller}, the assistant "
                        f"message before it, {why})"
                        "; the rollout loop never produces that sequence (after an answer without a call the "
                        "trajectory ends; one call gets one reply): drop the message or add the call")
                message["name"] = m.get("name") or pending[0]
                pending.pop(0)
            turns[-1].env.append(message)
    if not any(t.train for t in turns):
        raise DemonstrationError(f"{where}: every assistant message has {TRAIN_KEY}=false: nothing to train on")
    return Demonstration(index, prompt, _drop_trailing_env(turns), list(tools))


def split_parallel_calls(messages: list) -> list:
    """``messages`` with each assistant message of k > 1 structured ``tool_calls``, followed by its k
    tool replies, rewritten as k assistant messages of one call each, each followed by its reply (the
    content stays with the first call): the turns the rollout loop, which stops a turn at the first
    ``</tool_call>``, can sample. ValueError when fewer than k tool replies follow such a message.
    Later errors of the row number its messages as rewritten."""
    out: list = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = (m.get("tool_calls") or []) if isinstance(m, dict) and m.get("role") == "assistant" else []
        if len(calls) < 2:
            out.append(m)
            i += 1
            continue
        replies = messages[i + 1:i + 1 + len(calls)]
        if len(replies) < len(calls) or any(not isinstance(r, dict) or r.get("role") != "tool" for r in replies):
            raise ValueError(f"message {i} makes {len(calls)} tool calls but is not followed by {len(calls)} "
                             "tool replies, so its calls cannot be split one per turn")
        for k, (call, reply) in enumerate(zip(calls, replies)):
            out += [{**m, "content": m.get("content") if k == 0 else "", "tool_calls": [call]}, reply]
        i += 1 + len(calls)
    return out


def _row_messages(row: dict, where: str, task_cfg) -> list:
    if row.get("messages") is not None:
        messages = row["messages"]
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str):
            from mugrpo.rollout.tasks import render_messages

            prompt = ([{"role": "user", "content": prompt}] if task_cfg is None
                      else render_messages(prompt, task_cfg))
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise DemonstrationError(f"{where}: prompt and completion must each be a string or a list of messages")
        messages = list(prompt) + list(completion)
    elif row.get("text") is not None:
        raise DemonstrationError(f"{where} is plain text ('text'): a warm start needs chat turns, 'messages' "
                                 "or 'prompt' and 'completion', to know which tokens are the policy's")
    else:
        raise DemonstrationError(f"{where} has neither 'messages' nor 'prompt' and 'completion' "
                                 f"(its keys: {sorted(row)})")
    if not isinstance(messages, list) or not messages:
        raise DemonstrationError(f"{where}: the messages must be a non-empty list")
    return messages


def _row_tools(value, where: str) -> Optional[list]:
    """The row's ``tools`` column as a list of callables and schemas, or None when it has none."""
    if value is None:
        return None
    if isinstance(value, str):
        value = _json(value, f"{where}: the tools column")
    if not isinstance(value, list):
        raise DemonstrationError(f"{where}: the tools column must be a list of JSON schemas")
    tools = []
    for tool in value:
        if isinstance(tool, str):
            tool = _json(tool, f"{where}: a tool schema")
        if not (callable(tool) or (isinstance(tool, dict) and isinstance(tool.get("function"), dict))):
            raise DemonstrationError(f"{where}: a tool must be a JSON schema "
                                     '{"type": "function", "function": {...}} or a callable')
        tools.append(tool)
    return tools


def _json(text: str, what: str, kind: str = "a string that is "):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DemonstrationError(f"{what}: {kind}not JSON ({exc.msg})") from exc
    except RecursionError as exc:  # json's decoder recurses once per level: a hostile file ends here
        raise DemonstrationError(f"{what}: JSON nested too deeply to read (more than about "
                                 f"{sys.getrecursionlimit()} levels); flatten it") from exc


def _role(m, j: int, where: str) -> str:
    if not isinstance(m, dict) or m.get("role") is None:
        raise DemonstrationError(f"{where}: message {j} has no role")
    if m["role"] not in ROLES:
        raise DemonstrationError(f"{where}: message {j} has role {m['role']!r}; the roles are {list(ROLES)}")
    if m["role"] == "system" and j != 0:
        raise DemonstrationError(f"{where}: message {j} is a system message; only the first message may be one")
    return m["role"]


def _content(m: dict, j: int, where: str) -> str:
    content = m.get("content")
    if content is None and m["role"] == "assistant":
        return ""
    if not isinstance(content, str):
        raise DemonstrationError(f"{where}: message {j} ({m['role']}) has content of type {type(content).__name__}; "
                                 "give text")
    return check_text(content, f"{where}: message {j} ({m['role']})")


def check_text(text: str, where: str) -> str:
    """``text``, or DemonstrationError when it is not valid Unicode (a lone surrogate such as ``"\\ud800"``,
    which JSON can write and no tokenizer takes): found here, at load, not after the model has loaded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DemonstrationError(f"{where}: the text holds a lone surrogate {text[exc.start]!r} at character "
                                 f"{exc.start} (half of a UTF-16 pair, not a character); fix the text") from exc
    return text


def _train(m: dict, j: int, where: str) -> bool:
    value = m.get(TRAIN_KEY)
    if value is None:
        return m["role"] == "assistant"
    if not isinstance(value, bool):
        raise DemonstrationError(f"{where}: message {j} has {TRAIN_KEY}={value!r}; it must be true or false")
    if value and m["role"] != "assistant":
        raise DemonstrationError(f"{where}: message {j} ({m['role']}) has {TRAIN_KEY}=true; only assistant messages "
                                 "are trained on (the others are not the policy's tokens)")
    return value


def _plain_message(m, j: int, where: str) -> dict:
    """A prompt or environment message as the template gets it: role and content only."""
    role = _role(m, j, where)
    if role == "assistant":
        raise DemonstrationError(f"{where}: message {j} is an assistant message inside the prompt")
    if m.get("tool_calls"):
        raise DemonstrationError(f"{where}: message {j} ({role}) has tool_calls; only assistant messages call tools")
    _train(m, j, where)
    return {"role": role, "content": _content(m, j, where)}


def _policy_turn(m: dict, j: int, where: str, tools: dict) -> tuple[PolicyTurn, list[str]]:
    """The turn's text (content, then its call), checked as the rollout loop would parse it."""
    content, train = _content(m, j, where), _train(m, j, where)
    calls = [_structured_call(c, j, where) for c in _calls_of(m, j, where)]
    text = content
    for name, arguments in calls:
        text += ("\n" if text else "") + tool_call_text(name, arguments)
    check_text(text, f"{where}: message {j} (assistant, its tool call)")
    parsed = parse_tool_calls(text)
    for call in parsed:
        if call.error is not None:
            raise DemonstrationError(f"{where}: message {j} has a tool call the rollout loop cannot parse: "
                                     f"{call.error}")
        _check_call(call.name, call.arguments, tools, f"{where}: message {j}")
    if len(parsed) > 1:
        raise DemonstrationError(f"{where}: message {j} makes {len(parsed)} tool calls; a policy turn stops at its "
                                 "first </tool_call>, so write one assistant message per call, each followed by "
                                 "its tool reply")
    if parsed and not text.endswith("</tool_call>"):
        raise DemonstrationError(f"{where}: message {j} has text after its </tool_call>; a policy turn stops there, "
                                 "so that text could never be sampled")
    return PolicyTurn(text, bool(parsed), train), [c.name for c in parsed]


def _calls_of(m: dict, j: int, where: str) -> list:
    """The message's ``tool_calls`` as a list ([] when it has none); DemonstrationError for another type."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise DemonstrationError(f"{where}: message {j} has tool_calls of type {type(calls).__name__}; give a list "
                                 'of calls, [{"type": "function", "function": {"name": ..., "arguments": {...}}}] '
                                 "(one call is a list of one)")
    return calls


def _structured_call(call, j: int, where: str) -> tuple[str, dict]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        given = (f"a {type(call).__name__}" if not isinstance(fn, dict)
                 else f"a name of type {type(fn.get('name')).__name__}" if "name" in fn else "no name")
        raise DemonstrationError(f"{where}: message {j} has a tool call without a name ({given}); the shape is "
                                 '{"type": "function", "function": {"name": ..., "arguments": {...}}}')
    arguments = fn.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        arguments = _json(arguments, f"{where}: message {j}: the arguments of tool call {fn['name']!r}") \
            if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise DemonstrationError(f"{where}: message {j}: the arguments of tool call {fn['name']!r} must be a JSON "
                                 f"object, not {type(arguments).__name__}")
    return fn["name"], arguments


def _check_call(name: str, arguments: dict, tools: dict, where: str) -> None:
    if name not in tools:
        raise DemonstrationError(f"{where} calls tool {name!r}, which is not among the tools {sorted(tools)}")
    tool = tools[name]
    if callable(tool):
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as exc:
            raise DemonstrationError(f"{where}: the arguments of tool call {name!r} do not fit it: {exc}") from exc


def _drop_trailing_env(turns: list[PolicyTurn]) -> list[PolicyTurn]:
    """The last turn's environment messages come after every trained token: not rendered."""
    last = turns[-1]
    return turns[:-1] + [PolicyTurn(last.text, last.calls_tool, last.train)]
