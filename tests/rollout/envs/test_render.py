"""Token ids of environment turns, rendered once (mugrpo.rollout.envs.render).

The property the rollout loop relies on: the prompt and policy ids up to the policy's EOS, followed
by env_turn_ids(observations), equal the template's own rendering of the whole conversation."""

import copy

import pytest

from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.envs import render

pytestmark = pytest.mark.unit

# A Qwen2.5-style template (tools in the system turn, <tool_call> in assistant turns, tool results
# grouped into one user turn of <tool_response> blocks), short enough to read. transformers compiles
# templates with trim_blocks, which eats the newline after a tag: those newlines are written as {{ '\n' }}.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOL_OBS = [{"role": "tool", "name": "calculate", "content": "42"},
            {"role": "tool", "name": "calculate", "content": "7"}]
CONVERSATION = [{"role": "user", "content": "What is 6*7 and 3+4?"},
                {"role": "assistant", "content": "Let me compute. <tool_call>..."}]


@pytest.fixture(scope="module")
def smollm2():
    from mugrpo.models.loading import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def qwen_like(smollm2):
    tok = copy.deepcopy(smollm2)  # same <|im_start|>/<|im_end|> specials, a tool-aware template
    tok.chat_template = TOOL_TEMPLATE  # the support check is cached per template: no stale answer
    return tok


def ids(tok, messages, generation_prompt=False):
    out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)


def through_policy_eos(tok, messages):
    """The template's ids of ``messages`` cut after the last EOS: what the loop holds once the policy
    has sampled its EOS."""
    full = ids(tok, messages)
    return full[:len(full) - full[::-1].index(tok.eos_token_id)]


def test_tool_support_is_detected(smollm2, qwen_like):
    assert not render.supports_tools(smollm2)  # SmolLM2 drops tools and tool_calls
    assert render.supports_tools(qwen_like)
    assert not render.supports_tools(build_char_tokenizer())
    tiny = build_char_tokenizer()
    assert not render.supports_tools(tiny)
    tiny.chat_template = TOOL_TEMPLATE  # a changed template is checked again
    assert render.supports_tools(tiny)


def test_smollm2_env_turn_is_a_tool_response_user_turn(smollm2):
    turn = render.env_turn_ids(smollm2, TOOL_OBS)
    assert smollm2.decode(turn) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n"
                                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("observations", [TOOL_OBS, [{"role": "user", "content": "Incorrect, try again."}]])
def test_smollm2_env_turn_equals_the_whole_conversation_rendered(smollm2, observations):
    as_rendered = render.tool_messages_as_user(observations)
    whole = ids(smollm2, CONVERSATION + as_rendered, generation_prompt=True)
    assert through_policy_eos(smollm2, CONVERSATION) + render.env_turn_ids(smollm2, observations) == whole


def test_tool_aware_template_renders_tool_messages_itself(qwen_like):
    whole = ids(qwen_like, CONVERSATION + TOOL_OBS, generation_prompt=True)
    turn = render.env_turn_ids(qwen_like, TOOL_OBS)
    assert through_policy_eos(qwen_like, CONVERSATION) + turn == whole
    assert qwen_like.decode(turn) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n7\n"
                                      "</tool_response><|im_end|>\n<|im_start|>assistant\n")


# ChatML whose LAST assistant message gets an empty think block (as Qwen3's template does): the
# prefix render differs from the whole one before the EOS, so the id diff cannot be used.
THINK_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' and loop.last %}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_rendering_the_last_assistant_differently_falls_back_to_text(smollm2):
    tok = copy.deepcopy(smollm2)
    tok.chat_template = THINK_TEMPLATE
    feedback = [{"role": "user", "content": "Incorrect, try again."}]
    whole = ids(tok, CONVERSATION + feedback, generation_prompt=True)
    turn = render.env_turn_ids(tok, feedback)
    # the env turn is the whole rendering's tail after the assistant's EOS (no second EOS)
    assert whole[-len(turn):] == turn
    assert tok.decode(whole[:-len(turn)]).endswith("Let me compute. <tool_call>...<|im_end|>")
    assert tok.decode(turn) == "\n<|im_start|>user\nIncorrect, try again.<|im_end|>\n<|im_start|>assistant\n"
    assert render.env_turn_ids(tok, feedback, ended_with_eos=False) == [tok.eos_token_id] + turn


def test_a_turn_stopped_before_eos_is_closed_by_the_env_turn(smollm2):
    # The policy stopped at "</tool_call>": its EOS was never sampled, so the env turn starts with it.
    closed = render.env_turn_ids(smollm2, TOOL_OBS, ended_with_eos=False)
    assert closed == [smollm2.eos_token_id] + render.env_turn_ids(smollm2, TOOL_OBS)


def test_tiny_template_falls_back_to_the_text_after_the_assistant_turn():
    tok = build_char_tokenizer()  # turns are "r:content\n" lines: no EOS in the template
    turn = render.env_turn_ids(tok, [{"role": "user", "content": "Incorrect, try again."}])
    assert tok.decode(turn) == "\nu:Incorrect, try again.\na:"
    assert len(turn) == len("\nu:Incorrect, try again.\na:")  # one id per character
    assert tok.decode(render.env_turn_ids(tok, TOOL_OBS[:1])) == "\nu:<tool_response>\n42\n</tool_response>\na:"


def test_no_template_uses_the_plain_role_lines():
    tok = build_char_tokenizer()
    tok.chat_template = None
    assert tok.decode(render.env_turn_ids(tok, [{"role": "user", "content": "no"}])) == "\nuser: no\nassistant:"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression.
    """
    return expression


def test_prompt_teaches_the_protocol_when_the_template_has_no_tools(smollm2):
    text = smollm2.decode(render.prompt_ids(smollm2, [{"role": "user", "content": "2+2?"}], [calculate]))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "calculate"' in text
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_keeps_an_existing_system_message(smollm2):
    messages, schemas = render.prompt_messages(smollm2, [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "2+2?"}], [calculate])
    assert schemas is None and messages[0]["content"].startswith("Be brief.\n\n# Tools") and len(messages) == 2


def test_prompt_passes_schemas_to_a_tool_aware_template(qwen_like):
    messages, schemas = render.prompt_messages(qwen_like, [{"role": "user", "content": "2+2?"}], [calculate])
    assert messages == [{"role": "user", "content": "2+2?"}] and schemas[0]["function"]["name"] == "calculate"
    assert "<tools>" in qwen_like.decode(render.prompt_ids(qwen_like, messages, [calculate]))


def test_prompt_without_tools_is_the_plain_template(smollm2):
    messages = [{"role": "user", "content": "hi"}]
    assert render.prompt_ids(smollm2, messages) == ids(smollm2, messages, generation_prompt=True)


def test_empty_observations_are_refused(smollm2):
    with pytest.raises(ValueError, match="at least one"):
        render.env_turn_ids(smollm2, [])


def test_trajectory_prompt_without_tools_is_the_single_turn_prompt(smollm2):
    from mugrpo.config import TaskConfig
    from mugrpo.rollout.tasks import Item, prompt_ids as single_turn_ids

    cfg = TaskConfig(system_prompt="Be exact.", few_shot=[{"question": "1+1?", "answer": "\\boxed{2}"}])
    for item in (Item("2+2?", "4"), Item("2+2?", "4", {}, [{"role": "user", "content": "Two plus two?"}])):
        for tok in (smollm2, build_char_tokenizer()):
            assert render.trajectory_prompt_ids(tok, None, item, cfg) == single_turn_ids(tok, item.prompt, cfg)
    given = [{"role": "user", "content": "env prompt"}]
    assert render.trajectory_prompt_ids(smollm2, given, Item("2+2?", "4"), cfg) == ids(smollm2, given, True)
    with_tools = smollm2.decode(render.trajectory_prompt_ids(smollm2, None, Item("2+2?", "4"), cfg, [calculate]))
    assert with_tools.startswith("<|im_start|>system\nBe exact.\n\n# Tools") and "1+1?" in with_tools
