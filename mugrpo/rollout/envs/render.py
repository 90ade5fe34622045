"""Token ids for multi-turn rollouts: the prompt with its tools, and each environment turn, ONCE.

The rollout loop keeps the engine's sampled ids exactly and appends the ids of each environment
turn, computed here from that turn's messages alone; the conversation is never re-tokenized
(re-tokenization drift is a known bug class). Two ways, tried in order:

1. TRL's prefix/suffix diff (``_get_tool_suffix_ids``): render ``[user, assistant]`` and the same
   plus the environment's messages with the generation prompt; cut the first after its last EOS
   token; the ids after the cut are the turn. With an EOS-terminated template (ChatML: SmolLM2,
   Qwen) the ids equal what the template gives for the whole conversation, from the policy's EOS on.
2. Otherwise (a template whose turns do not end in EOS, as mugrpo.models.tiny's ``u:...`` lines,
   or one that renders the last assistant message differently, as Qwen3's adds an empty think
   block): the text after a sentinel assistant message, tokenized on its own, less a leading EOS
   (the policy's). No template at all: ``role: content`` lines.

A policy turn that ended at a stop string instead of EOS (e.g. ``</tool_call>``) has not closed
its assistant message, so its environment turn starts with the EOS id (``ended_with_eos=False``).

Tool messages (``role: "tool"``) are rendered by the template when it renders tool calls itself
(:func:`supports_tools`, TRL's sentinel check); otherwise consecutive tool messages become one user
turn of ``<tool_response>`` blocks, as Qwen's template writes them, so a model never sees a role
it was not trained on. The prompt gets the tools the same way: ``tools=`` for a tool-aware
template, else :func:`mugrpo.rollout.envs.tools.protocol_text` in the system message.

This module knows nothing about environments' logic, rewards or engines.
"""

from __future__ import annotations

from typing import Callable, Optional

from mugrpo.rollout.envs.tools import protocol_text, tool_schemas
from mugrpo.rollout.text_cut import char_limit, cut_messages

__all__ = ["supports_tools", "prompt_messages", "prompt_ids", "trajectory_prompt_ids", "env_turn_ids",
           "tool_messages_as_user"]

_SENTINEL = "MUGRPO_SENTINEL_7f3a"
_DUMMY_USER = {"role": "user", "content": "mugrpo"}


def _render(tokenizer, messages: list[dict], tools=None, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                         tokenize=False)


def _ids(tokenizer, messages: list[dict], tools=None, generation_prompt: bool = False) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def supports_tools(tokenizer) -> bool:
    """True if the chat template renders tool schemas, assistant tool calls and tool results
    (TRL's check: every sentinel must appear in the rendered text). Cached on the tokenizer, per template."""
    template = getattr(tokenizer, "chat_template", None)
    cached = getattr(tokenizer, "_mugrpo_supports_tools", None)
    if cached is not None and cached[0] == template:
        return cached[1]
    ok = False
    if template:
        schema = {"type": "function", "function": {
            "name": f"{_SENTINEL}_fn", "description": f"{_SENTINEL}_doc",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "x"}},
                           "required": ["x"]}}}
        call = {"type": "function", "function": {"name": f"{_SENTINEL}_fn", "arguments": {"x": f"{_SENTINEL}_arg"}}}
        messages = [_DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": f"{_SENTINEL}_fn", "content": f"{_SENTINEL}_result"}]
        try:
            text = _render(tokenizer, messages, tools=[schema])
            ok = all(f"{_SENTINEL}_{s}" in text for s in ("doc", "arg", "result")) and text.count(
                f"{_SENTINEL}_fn") >= 2  # once in the schema, once in the call
        except Exception:  # noqa: BLE001 - a template may reject tool messages outright: no support
            ok = False
    try:
        tokenizer._mugrpo_supports_tools = (template, ok)
    except AttributeError:
        pass
    return ok


def tool_messages_as_user(messages: list[dict]) -> list[dict]:
    """``messages`` with each run of tool messages merged into one user turn of
    ``<tool_response>`` blocks (for templates that do not render tools)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] != "tool":
            out.append(m)
            continue
        block = f"<tool_response>\n{m['content']}\n</tool_response>"
        if out and out[-1].get("_tool_run"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "_tool_run": True})
    return [{k: v for k, v in m.items() if k != "_tool_run"} for m in out]


def prompt_messages(tokenizer, messages: list[dict], tools: list[Callable] = ()) -> tuple[list[dict], Optional[list]]:
    """The prompt messages and the ``tools=`` argument for the template: the schemas when the
    template renders tools, else None and the protocol text in the system message. A tool is a
    callable or its JSON schema already made (a dict, as a dataset's ``tools`` column holds)."""
    if not tools:
        return list(messages), None
    schemas = [t if isinstance(t, dict) else tool_schemas([t])[0] for t in tools]
    if supports_tools(tokenizer):
        return list(messages), schemas
    text = protocol_text(schemas)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def prompt_ids(tokenizer, messages: list[dict], tools: list[Callable] = ()) -> list[int]:
    """Token ids of the prompt ``messages`` with ``tools``, ending with the generation prompt."""
    messages, schemas = prompt_messages(tokenizer, messages, tools)
    if getattr(tokenizer, "chat_template", None):
        return _ids(tokenizer, messages, schemas, generation_prompt=True)
    return _plain_ids(tokenizer, messages, add_special_tokens=True)


def trajectory_prompt_ids(tokenizer, env_messages: Optional[list[dict]], item, task_cfg,
                          tools: list[Callable] = ()) -> list[int]:
    """The first prompt of a trajectory: the messages ``env.reset`` returned, else the task's usual
    prompt (:func:`mugrpo.rollout.tasks.prompt_ids`' messages), with the environment's ``tools``.
    Without tools and messages it is exactly the single-turn prompt. Each message is first cut to the
    characters ``task.max_prompt_tokens`` can use (its end kept, as by
    :func:`mugrpo.rollout.tasks.prompt_ids`): a 15 MB ``reset`` prompt is never tokenized whole, and
    is over the limit either way (``task.prompt_too_long`` skips or refuses it)."""
    from mugrpo.rollout.tasks import render_messages

    if env_messages is None:
        env_messages = item.messages if item.messages is not None else render_messages(item.question, task_cfg)
    max_tokens = getattr(task_cfg, "max_prompt_tokens", None)
    if max_tokens is not None:
        env_messages = cut_messages(env_messages, char_limit(tokenizer, max_tokens), keep="end")[0]
    return prompt_ids(tokenizer, env_messages, tools)


def _plain_ids(tokenizer, messages: list[dict], add_special_tokens: bool, lead: str = "") -> list[int]:
    # The "role: content" lines mugrpo.rollout.tasks.prompt_ids writes for a tokenizer without a template.
    text = lead + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def env_turn_ids(tokenizer, observations: list[dict], ended_with_eos: bool = True) -> list[int]:
    """Token ids of one environment turn: ``observations`` (the messages an environment step
    returned) and the next assistant header, to append after the policy's last sampled token.

    ``ended_with_eos``: the policy turn ended with the EOS token (it was sampled and is already in
    the sequence); False when it stopped at a stop string, so this turn must close it first."""
    if not observations:
        raise ValueError("env_turn_ids needs at least one observation message")
    if not getattr(tokenizer, "chat_template", None):
        return _plain_ids(tokenizer, tool_messages_as_user(observations), False, lead="\n")
    if not supports_tools(tokenizer):
        observations = tool_messages_as_user(observations)
    ids = _eos_diff(tokenizer, observations)
    closing = [] if ended_with_eos else [tokenizer.eos_token_id]
    if ids is not None:
        return closing + ids
    return _sentinel_diff(tokenizer, observations, closing)


def _eos_diff(tokenizer, observations: list[dict]) -> Optional[list[int]]:
    """TRL's diff: the ids after the prefix's last EOS, or None when the template's assistant turn
    does not end in EOS or the full render does not extend the prefix."""
    eos = tokenizer.eos_token_id
    prefix = [_DUMMY_USER, {"role": "assistant", "content": _SENTINEL}]
    prefix_ids = _ids(tokenizer, prefix)
    full_ids = _ids(tokenizer, prefix + list(observations), generation_prompt=True)
    if eos is None or eos not in prefix_ids:
        return None
    cut = len(prefix_ids) - prefix_ids[::-1].index(eos)
    if full_ids[:cut] != prefix_ids[:cut] or _SENTINEL not in tokenizer.decode(prefix_ids[:cut]):
        return None  # the EOS found was not the one closing the assistant turn
    return full_ids[cut:]


def _sentinel_diff(tokenizer, observations: list[dict], closing: list[int]) -> list[int]:
    """The text after a sentinel assistant message, tokenized on its own. When that text starts with
    the EOS token (a template that closes turns with EOS but renders the last assistant message
    differently, as Qwen3's adds an empty think block), the EOS is the policy's (``closing``)."""
    text = _render(tokenizer, [_DUMMY_USER, {"role": "assistant", "content": _SENTINEL}, *observations],
                   generation_prompt=True)
    tail = text[text.index(_SENTINEL) + len(_SENTINEL):]
    eos_text = tokenizer.eos_token
    if eos_text and tail.startswith(eos_text):
        return closing + tokenizer(tail[len(eos_text):], add_special_tokens=False)["input_ids"]
    return tokenizer(tail, add_special_tokens=False)["input_ids"]
