"""Text cut by characters before it is tokenized, so a huge message never reaches a tokenizer whole.

A tokenizer's memory grows with the text it is handed (the tiny model took 737 MB for 1 MB of
text, over 4 GB for 10 MB), and a token limit is applied only to the ids it returns. So every text
that enters a run (a demonstration's messages, a dataset's prompt, an environment's ``reset``
prompt; step observations and tool results have ``env.max_observation_chars``) is first cut to
:func:`char_limit` characters for the token limit that applies to it.

**Why the cut changes no kept token.** Every token of a vocabulary spells at most ``L`` characters
(:func:`longest_token_chars`, its longest entry), so ``n`` characters take at least ``n / L``
tokens. A text cut to ``max_tokens * L + 1`` characters still takes more than ``max_tokens``
tokens: whatever the token limit keeps (the first ``max_tokens`` for a demonstration; a prompt over
``task.max_prompt_tokens`` is refused, skipped or cut to its tail) lies inside what the cut kept,
except for the few tokens that straddle the cut itself. The one exception is a tokenizer that maps
a long unknown word to one ``<unk>`` token: its cut word is still one ``<unk>``.

This module knows nothing about tasks, environments or demonstrations: it takes messages and a
tokenizer.
"""

from __future__ import annotations

__all__ = ["longest_token_chars", "char_limit", "cut_text", "cut_messages"]


def longest_token_chars(tokenizer) -> int:
    """The characters of the vocabulary's longest token (special tokens included), at least 1; cached
    on the tokenizer. Byte-level vocabularies spell a byte per character, so this bounds the decoded
    characters of any token."""
    cached = getattr(tokenizer, "_mugrpo_longest_token", None)
    if cached is not None:
        return cached
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    try:
        tokenizer._mugrpo_longest_token = max(longest, 1)
    except AttributeError:
        pass
    return max(longest, 1)


def char_limit(tokenizer, max_tokens: int) -> int:
    """The characters a text may keep when at most ``max_tokens`` of its tokens can be used: one more
    than ``max_tokens`` of the longest token, so a cut text is still over the token limit."""
    return max(int(max_tokens), 1) * longest_token_chars(tokenizer) + 1


def cut_text(text: str, max_chars: int, keep: str = "start") -> tuple[str, bool]:
    """``text`` cut to ``max_chars`` characters, keeping its ``start`` or its ``end``; and whether it was cut."""
    if len(text) <= max_chars:
        return text, False
    return (text[:max_chars] if keep == "start" else text[len(text) - max_chars:]), True


def cut_messages(messages: list[dict], max_chars: int, keep: str = "start") -> tuple[list[dict], int]:
    """``messages`` with each string ``content`` cut by :func:`cut_text` (new dicts where cut), and
    how many were cut."""
    out, num_cut = [], 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str) and len(content) > max_chars:
            m = {**m, "content": cut_text(content, max_chars, keep)[0]}
            num_cut += 1
        out.append(m)
    return out, num_cut
