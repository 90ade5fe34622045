"""A demonstration as token ids, a loss mask and turn indices, rendered as the rollout loop renders it.

The ids are what :mod:`mugrpo.rollout.multiturn` holds for the same conversation, id for id, when
the policy samples the demonstration's turns (``tests/warmstart/test_render_rollout_equivalence.py``):

- the prompt: the messages before the first assistant message, with the tools,
  :func:`mugrpo.rollout.envs.render.prompt_ids` (what :func:`~mugrpo.rollout.envs.render.trajectory_prompt_ids`
  gives a trajectory);
- each policy turn: its text (content, then its ``<tool_call>`` block) tokenized on its own, as the
  model samples it after the generation prompt. A turn without a call is a final answer (or an
  attempt) and ends with the EOS the policy samples; a turn with a call ends at ``</tool_call>``,
  the stop string, and has no EOS;
- each environment turn (the tool replies or user messages after a policy turn):
  :func:`mugrpo.rollout.envs.render.env_turn_ids`, with ``ended_with_eos`` False after a tool call,
  so that turn starts with the EOS that closes the assistant message.

**The mask**: 1 on the policy turns' tokens (text, tool call and the EOS the policy samples), 0 on
the prompt and on every environment token. So on the response it is exactly a rollout
trajectory's ``turns >= 0`` (``StageData.turns``: the tokens the RL loss trains), except for turns a
demonstration marks ``train: false`` (0 there, turn index kept). In particular the EOS after a
tool-call turn is NOT trained: at rollout the stop string ends that turn, the EOS is appended by
the environment turn (``turns == -1``). The model is thereby taught to stop at ``</tool_call>``
with the stop string, which is how mugrpo samples it.

**The length rule: truncate and count.** A demonstration over ``max_length`` tokens keeps its first
``max_length`` (TRL's ``max_length``, keep-start; as a rollout cut at its token budget); one with no
trained token left (the prompt alone fills it) is dropped. Both are counted.

**Cut by characters first.** Before any text is tokenized, each message and each policy turn's text
is cut to the characters ``max_length`` tokens can use (:func:`mugrpo.rollout.text_cut.char_limit`:
``max_length`` times the vocabulary's longest token, plus one), keeping its start, and rendering
stops once the example is past ``max_length`` tokens: a 10 MB message is never tokenized whole. A
cut text still takes more than ``max_length`` tokens, so the kept example (and its loss mask) is the
one the token rule keeps from the whole text; the turns after a cut are past the limit and dropped
with it. Cuts are counted (``num_cut_texts``); a cut example is also counted as truncated.

This module knows nothing about optimisers or models: :class:`Example` is the input of a training
step that lives elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mugrpo.rollout.envs import render as rollout_render
from mugrpo.rollout.text_cut import char_limit, cut_messages, cut_text
from mugrpo.warmstart.data import Demonstration, DemonstrationError

__all__ = ["ENV_TURN", "Example", "render_demonstration", "render_demonstrations", "hold_to_length", "truncate"]

ENV_TURN = -1
"""The turn index of an environment token (``StageData.turns``' convention)."""


@dataclass(frozen=True)
class Example:
    """One token-level SFT example: the prompt, then the response (policy and environment turns)."""

    prompt_ids: list[int]
    response_ids: list[int]
    turns: list[int]
    """One per response token: k >= 0 for policy turn k, :data:`ENV_TURN` for an environment token."""
    response_mask: list[int]
    """One per response token: 1 = in the loss."""
    source: Any = None
    """Where it came from: a demonstration's row index, or (stage, shard, sequence) of a run."""

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def loss_mask(self) -> list[int]:
        """One per input token: 0 on the prompt, :attr:`response_mask` on the response."""
        return [0] * len(self.prompt_ids) + self.response_mask

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.response_mask)


def render_demonstration(tokenizer, demo: Demonstration, max_length: Optional[int] = None) -> Example:
    """``demo`` as ids, mask and turns (the module docstring says how); with ``max_length``, its texts
    cut by characters first and the turns past ``max_length`` tokens left out (:func:`truncate` still
    holds it to the limit)."""
    return _render(tokenizer, demo, max_length)[0]


def _render(tokenizer, demo: Demonstration, max_length: Optional[int]) -> tuple[Example, int]:
    """The example, and how many of its texts were cut by characters."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DemonstrationError("the tokenizer has no eos_token: a final answer must end with one")
    max_chars = None if max_length is None else char_limit(tokenizer, max_length)
    prompt_messages, num_cut = demo.prompt, 0
    if max_chars is not None:
        prompt_messages, num_cut = cut_messages(demo.prompt, max_chars)
    prompt = rollout_render.prompt_ids(tokenizer, prompt_messages, demo.tools)
    response: list[int] = []
    turns: list[int] = []
    mask: list[int] = []

    def add(ids: list[int], turn: int, trained: bool) -> None:
        response.extend(ids)
        turns.extend([turn] * len(ids))
        mask.extend([int(trained)] * len(ids))

    for k, turn in enumerate(demo.turns):
        if max_length is not None and len(prompt) + len(response) >= max_length:
            break  # the rest is past the limit: the token rule would cut it
        text, env = turn.text, turn.env
        if max_chars is not None:
            text, cut = cut_text(text, max_chars)
            env, env_cut = cut_messages(env, max_chars)
            num_cut += cut + env_cut
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        add(list(ids) + ([] if turn.calls_tool else [eos]), k, turn.train)
        if env:
            add(rollout_render.env_turn_ids(tokenizer, env, ended_with_eos=not turn.calls_tool), ENV_TURN, False)
    return Example(list(prompt), response, turns, mask, demo.index), num_cut


def truncate(example: Example, max_length: int) -> Optional[Example]:
    """``example`` cut to its first ``max_length`` tokens; None when no trained token is left."""
    room = max_length - len(example.prompt_ids)
    if room < 1 or sum(example.response_mask[:room]) == 0:
        return None
    if room >= len(example.response_ids):
        return example
    return Example(example.prompt_ids, example.response_ids[:room], example.turns[:room],
                   example.response_mask[:room], example.source)


def render_demonstrations(tokenizer, demos: list[Demonstration], max_length: int,
                          on_row=None) -> tuple[list[Example], dict]:
    """Every demonstration rendered and held to ``max_length`` tokens, and the counts:
    ``num_demonstrations``, ``num_truncated`` (kept, cut), ``num_dropped`` (nothing trained left),
    ``num_loss_tokens`` (over the kept examples), ``num_cut_texts`` (texts cut by characters before
    they were tokenized). ``on_row()``: after each one (progress, a stop check)."""
    rendered = []
    for demo in demos:
        rendered.append(_render(tokenizer, demo, max_length))
        if on_row is not None:
            on_row()
    examples, counts = hold_to_length([example for example, _ in rendered], max_length)
    return examples, {**counts, "num_cut_texts": sum(n for _, n in rendered)}


def hold_to_length(examples: list[Example], max_length: int) -> tuple[list[Example], dict]:
    """``examples`` held to ``max_length`` tokens (:func:`truncate`), with the counts of
    :func:`render_demonstrations`."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a prompt token and a trained one), got {max_length}")
    kept, num_truncated, num_dropped = [], 0, 0
    for full in examples:
        cut = truncate(full, max_length)
        if cut is None:
            num_dropped += 1
            continue
        num_truncated += cut is not full
        kept.append(cut)
    counts = {"num_demonstrations": len(examples), "num_truncated": num_truncated, "num_dropped": num_dropped,
              "num_loss_tokens": sum(e.num_loss_tokens for e in kept)}
    return kept, counts
