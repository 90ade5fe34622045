"""Text cut by characters before it is tokenized (mugrpo.rollout.text_cut): the bound, and that the
tokens a limit keeps are the ones it kept from the whole text."""

import pytest

from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.text_cut import char_limit, cut_messages, cut_text, longest_token_chars


@pytest.fixture(scope="module")
def tiny():
    return build_char_tokenizer()


def test_the_limit_is_the_longest_token_times_the_tokens_plus_one(tiny):
    # The tiny vocabulary: one character per token, and "<pad>", "<eos>", "<unk>" of 5 characters.
    assert longest_token_chars(tiny) == 5
    assert char_limit(tiny, 10) == 10 * 5 + 1


@pytest.mark.unit
def test_cut_text_keeps_the_start_or_the_end():
    assert cut_text("abcdef", 4) == ("abcd", True)
    assert cut_text("abcdef", 4, keep="end") == ("cdef", True)
    assert cut_text("abc", 4) == ("abc", False)
    messages = [{"role": "user", "content": "abcdef"}, {"role": "tool", "content": "ok", "name": "f"}]
    out, num_cut = cut_messages(messages, 3, keep="end")
    assert out == [{"role": "user", "content": "def"}, {"role": "tool", "content": "ok", "name": "f"}]
    assert num_cut == 1 and messages[0]["content"] == "abcdef"  # the caller's message is not changed


def test_a_cut_text_keeps_every_token_the_limit_keeps(tiny):
    # Any text over char_limit(max_tokens) is still over max_tokens tokens once cut, and its first
    # max_tokens ids are the whole text's; here with "<eos>" pieces, tokens of 5 characters each.
    text = "<eos>" * 30 + "x" * 1000
    cut, was_cut = cut_text(text, char_limit(tiny, 20))
    ids_cut, ids_whole = tiny(cut, add_special_tokens=False)["input_ids"], tiny(text, add_special_tokens=False)[
        "input_ids"]
    assert was_cut and len(ids_cut) > 20 and ids_cut[:20] == ids_whole[:20]
