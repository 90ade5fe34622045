"""Rendering demonstrations (mugrpo.warmstart.render): ids, masks and turns by hand on the
character-level tokenizer (one id per character), the real ChatML template, and the length rule."""

import pytest

from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.envs import render as rollout_render
from mugrpo.rollout.envs.builtin import calculate
from mugrpo.warmstart.data import load_demonstrations
from mugrpo.warmstart.demos import calculator_rows
from mugrpo.warmstart.render import Example, render_demonstration, render_demonstrations, truncate

pytestmark = pytest.mark.unit

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tiny():
    return build_char_tokenizer()  # turns are "r:content\n" lines; EOS only where the policy samples it


def one(rows, tools=()):
    return load_demonstrations(rows, tools=tools)


def test_a_single_answer(tiny):
    (demo,) = one([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    ex = render_demonstration(tiny, demo)
    # prompt "u:hi\na:" = 7 characters; response "yo" + the EOS the policy samples = 3 tokens, all trained
    assert tiny.decode(ex.prompt_ids) == "u:hi\na:" and len(ex.prompt_ids) == 7
    assert ex.response_ids == tiny("yo", add_special_tokens=False)["input_ids"] + [tiny.eos_token_id]
    assert (ex.turns, ex.response_mask) == ([0, 0, 0], [1, 1, 1])
    assert ex.loss_mask == [0] * 7 + [1] * 3 and ex.input_ids == ex.prompt_ids + ex.response_ids
    assert (ex.num_loss_tokens, ex.source) == (3, 0)


def test_a_tool_call_its_reply_and_the_answer(tiny):
    row = {"messages": [{"role": "user", "content": "6 * 7?"},
                        {"role": "assistant", "tool_calls": [
                            {"type": "function", "function": {"name": "calculate",
                                                              "arguments": '{"expression": "6 * 7"}'}}]},
                        {"role": "tool", "content": "42"},
                        {"role": "assistant", "content": "\\boxed{42}"}]}
    (demo,) = one([row], tools=[calculate])
    ex = render_demonstration(tiny, demo)
    # The prompt is the rollout's: the protocol in a system message, then the user turn.
    assert ex.prompt_ids == rollout_render.prompt_ids(tiny, [{"role": "user", "content": "6 * 7?"}], [calculate])
    env = "\nu:<tool_response>\n42\n</tool_response>\na:"  # the tool reply as a user turn, then the header
    answer = "\\boxed{42}"
    assert tiny.decode(ex.response_ids) == CALL + env + answer + "<eos>"
    # Trained: the call (no EOS: the stop string ends that turn), the answer and its EOS; not the reply.
    assert ex.response_mask == [1] * len(CALL) + [0] * len(env) + [1] * (len(answer) + 1)
    assert ex.turns == [0] * len(CALL) + [-1] * len(env) + [1] * (len(answer) + 1)
    # '<tool_call>' 11 + newline 1 + the JSON 59 + newline 1 + '</tool_call>' 12 = 84 call characters;
    # the JSON: '{' 1 + '"name"' 6 + ': ' 2 + '"calculate"' 11 + ', ' 2 + '"arguments"' 11 + ': ' 2 + '{' 1
    # + '"expression"' 12 + ': ' 2 + '"6 * 7"' 7 + '}}' 2 = 59. With '\\boxed{42}' (10) and its EOS: 84 + 10 + 1 = 95.
    assert ex.num_loss_tokens == 95


def test_an_untrained_turn_keeps_its_turn_index(tiny):
    (demo,) = one([{"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "5", "train": False},
                                 {"role": "user", "content": "No."}, {"role": "assistant", "content": "4"}]}])
    ex = render_demonstration(tiny, demo)
    # "5" + EOS (turn 0, not trained), "\nu:No.\na:" (9 environment tokens), "4" + EOS (turn 1, trained)
    assert tiny.decode(ex.response_ids) == "5<eos>\nu:No.\na:4<eos>"
    assert ex.turns == [0, 0] + [-1] * 9 + [1, 1]
    assert ex.response_mask == [0, 0] + [0] * 9 + [1, 1]


def test_without_a_chat_template_the_plain_role_lines():
    tok = build_char_tokenizer()
    tok.chat_template = None  # a base model: "role: content" lines, as the rollout's prompt and env turns
    (demo,) = one([{"messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "5", "train": False},
                                 {"role": "user", "content": "No."}, {"role": "assistant", "content": "4"}]}])
    ex = render_demonstration(tok, demo)
    assert tok.decode(ex.prompt_ids) == "user: q\nassistant:"
    # "5" + EOS (2), "\nuser: No.\nassistant:" ("\n" 1 + "user: No." 9 + "\n" 1 + "assistant:" 10 = 21
    # environment tokens), "4" + EOS (2)
    assert tok.decode(ex.response_ids) == "5<eos>\nuser: No.\nassistant:4<eos>"
    assert ex.turns == [0, 0] + [-1] * 21 + [1, 1] and ex.response_mask == [0] * 23 + [1, 1]


@pytest.fixture(scope="module")
def smollm2():
    from mugrpo.models.loading import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m-instruct"))


def test_smollm2_sft_ids_are_the_templates_ids_of_the_whole_conversation(smollm2):
    # ChatML ends every turn with EOS, so the template's rendering of the whole conversation (tool
    # calls as assistant text, tool replies as <tool_response> user turns, as SmolLM2 is prompted) is
    # the SFT ids plus the newline the template writes after the final <|im_end|>.
    (demo,) = load_demonstrations(calculator_rows(1, seed=2, num_calls=2))
    ex = render_demonstration(smollm2, demo)
    messages, _ = rollout_render.prompt_messages(smollm2, demo.prompt, demo.tools)
    for turn in demo.turns:
        messages = messages + [{"role": "assistant", "content": turn.text}] + rollout_render.tool_messages_as_user(
            turn.env)
    whole = list(smollm2.apply_chat_template(messages, tokenize=True)["input_ids"])
    assert whole[:-1] == ex.input_ids and smollm2.decode(whole[-1:]) == "\n"
    assert smollm2.decode(ex.response_ids).startswith("<tool_call>\n{\"name\": \"calculate\"")


def example(prompt_len, mask):
    n = len(mask)
    return Example(list(range(prompt_len)), list(range(100, 100 + n)), [0] * n, list(mask), "x")


def test_truncate_keeps_the_start_and_drops_what_has_nothing_trained():
    ex = example(3, [1, 1, 0, 1])  # 3 + 4 = 7 tokens
    assert truncate(ex, 7) is ex  # fits: unchanged
    cut = truncate(ex, 5)  # 5 - 3 = 2 response tokens left
    assert (cut.response_ids, cut.response_mask, cut.turns, cut.prompt_ids) == ([100, 101], [1, 1], [0, 0], [0, 1, 2])
    assert truncate(ex, 3) is None  # the prompt fills it
    assert truncate(example(3, [0, 0, 1]), 5) is None  # 2 tokens left, neither trained


def test_render_demonstrations_counts_truncated_and_dropped(tiny):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": c}]}
            for c in ("yo", "hello", "a")]
    # prompts "u:hi\na:" = 7 tokens; responses "yo"+EOS = 3, "hello"+EOS = 6, "a"+EOS = 2 tokens
    examples, counts = render_demonstrations(tiny, load_demonstrations(rows), max_length=10)
    # 7 + 3 = 10 fits; 7 + 6 = 13 is cut to 3 response tokens; 7 + 2 = 9 fits
    assert [len(e.input_ids) for e in examples] == [10, 10, 9]
    assert counts == {"num_demonstrations": 3, "num_truncated": 1, "num_dropped": 0, "num_loss_tokens": 3 + 3 + 2,
                      "num_cut_texts": 0}  # 10 tokens of the tiny vocabulary (5 characters at most) keep 51 characters
    examples, counts = render_demonstrations(tiny, load_demonstrations(rows), max_length=7)
    assert examples == [] and (counts["num_dropped"], counts["num_loss_tokens"]) == (3, 0)
    with pytest.raises(ValueError, match="max_length"):
        render_demonstrations(tiny, load_demonstrations(rows), max_length=1)
