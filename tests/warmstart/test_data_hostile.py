"""Demonstrations checked like rollouts, and hostile input refused with a message naming the row and
what is wrong (mugrpo.warmstart.data, mugrpo.warmstart.source, mugrpo.warmstart.demos)."""

import json

import pytest

from mugrpo.config import dump_yaml, load_config
from mugrpo.rollout.envs.builtin import calculate
from mugrpo.warmstart.data import DemonstrationError, load_demonstrations
from mugrpo.warmstart.source import load_source

pytestmark = pytest.mark.unit


def call(expression="6 * 7", name="calculate"):
    return {"type": "function", "function": {"name": name, "arguments": {"expression": expression}}}


def row(*tail, prompt=None):
    """A user question, then ``tail``."""
    return {"messages": [*(prompt or [{"role": "user", "content": "6 * 7?"}]), *tail]}


ANSWER = {"role": "assistant", "content": "\\boxed{42}"}
CALLING = {"role": "assistant", "content": None, "tool_calls": [call()]}
REPLY = {"role": "tool", "content": "42"}


def refused(rows, match, **kwargs):
    with pytest.raises(DemonstrationError, match=match):
        load_demonstrations(rows, tools=[calculate], **kwargs)


@pytest.mark.unit
def test_the_turn_grammar_of_the_rollout_loop_is_accepted():
    (demo,) = load_demonstrations([row(CALLING, REPLY, CALLING, REPLY, ANSWER)], tools=[calculate])
    assert [t.calls_tool for t in demo.turns] == [True, True, False]
    assert [t.env for t in demo.turns[:2]] == [[{"role": "tool", "content": "42", "name": "calculate"}]] * 2


@pytest.mark.unit
def test_a_tool_reply_after_an_answer_without_a_call_is_refused():
    # The rollout loop ends a trajectory at an answer without a call: its EOS and anything after
    # it could never be sampled.
    refused([row(ANSWER, REPLY, ANSWER)],
            r"demonstration row 0: message 2 is a tool reply that answers no call \(message 1, .* calls no tool\)")


@pytest.mark.unit
def test_two_replies_to_one_call_are_refused():
    refused([row(CALLING, REPLY, REPLY, ANSWER)],
            r"row 0: message 3 is a tool reply that answers no call \(message 1, .* has no call left unanswered\)")


@pytest.mark.unit
def test_a_call_left_unanswered_before_the_next_turn_is_refused():
    refused([row(CALLING, {"role": "user", "content": "go on"}, ANSWER)],
            r"row 0: message 1 calls 'calculate', but no tool reply answers it before message 3")


@pytest.mark.unit
def test_a_tool_message_as_the_prompt_is_refused():
    refused([row(ANSWER, prompt=[REPLY])], r"row 0: message 0 is a tool reply in the prompt")
    refused([row(ANSWER, prompt=[{"role": "user", "content": "q"}, REPLY])], r"row 0: message 1 is a tool reply")


@pytest.mark.unit
@pytest.mark.parametrize("name", [5, None, ["calculate"], ""])
def test_a_tool_schema_whose_name_is_not_a_string_is_refused(name):
    schema = {"type": "function", "function": {"name": name, "parameters": {}}}
    with pytest.raises(DemonstrationError, match=rf"row 1: a tool is neither .* \(its name: {name!r}\)".replace(
            "[", r"\[").replace("]", r"\]")):
        load_demonstrations([row(ANSWER), {**row(ANSWER), "tools": [schema]}])


@pytest.mark.unit
@pytest.mark.parametrize("tool_calls,kind", [(call(), "dict"), ("calculate(6 * 7)", "str")])
def test_tool_calls_that_are_not_a_list_name_their_type(tool_calls, kind):
    message = {"role": "assistant", "content": "", "tool_calls": tool_calls}
    refused([row(message, REPLY, ANSWER)], rf"row 0: message 1 has tool_calls of type {kind}; give a list")
    refused([row(message, REPLY, ANSWER)], rf"message 1 has tool_calls of type {kind}", split_calls=True)


@pytest.mark.unit
def test_a_call_that_is_not_a_mapping_says_what_it_is():
    message = {"role": "assistant", "content": "", "tool_calls": ["calculate"]}
    refused([row(message, REPLY, ANSWER)], r"message 1 has a tool call without a name \(a str\)")


@pytest.mark.unit
def test_a_lone_surrogate_is_refused_at_load_naming_row_and_message():
    text = json.loads('"6 \\ud800 7?"')  # JSON can write half a UTF-16 pair; no tokenizer takes it
    refused([row(ANSWER), row(ANSWER, prompt=[{"role": "user", "content": text}])],
            r"demonstration row 1: message 0 \(user\): the text holds a lone surrogate '\\ud800' at character 2")
    refused([row({"role": "assistant", "content": None, "tool_calls": [call(text)]}, REPLY, ANSWER)],
            r"row 0: message 1 \(assistant, its tool call\): the text holds a lone surrogate")


@pytest.mark.unit
def test_a_bad_row_from_python_is_named_with_what_was_expected():
    with pytest.raises(DemonstrationError, match=r"demonstration row 1 is a list, not a dict; each row is a dict"):
        load_demonstrations([row(ANSWER), [{"role": "user", "content": "q"}]])
    with pytest.raises(DemonstrationError, match=r"demonstration row 0 is a int, not a dict"):
        load_demonstrations([1, 2])
    with pytest.raises(DemonstrationError, match=r"not int"):
        load_demonstrations(7)


@pytest.mark.unit
@pytest.mark.parametrize("suffix,text", [
    (".jsonl", '{"messages": ' + "[" * 5000 + "]" * 5000 + "}\n"),
    (".json", "[" * 5000 + "]" * 5000),
])
def test_deeply_nested_json_is_refused_with_a_message(tmp_path, suffix, text):
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    with pytest.raises(DemonstrationError, match=r"deep\.jsonl?(, line 1)?: JSON nested too deeply to read"):
        load_demonstrations(path)


@pytest.mark.unit
def test_a_file_that_is_not_regular_is_not_called_missing(tmp_path):
    with pytest.raises(DemonstrationError, match=r"/dev/null is not a regular file"):
        load_demonstrations("/dev/null")
    with pytest.raises(DemonstrationError, match=r"is not a regular file"):
        load_demonstrations(tmp_path)
    with pytest.raises(DemonstrationError, match=r"nothing\.jsonl does not exist"):
        load_demonstrations(tmp_path / "nothing.jsonl")


@pytest.mark.unit
def test_upper_case_suffixes_are_read(tmp_path):
    (tmp_path / "demos.JSONL").write_text(json.dumps(row(ANSWER)) + "\n")
    (tmp_path / "demos.Json").write_text(json.dumps([row(ANSWER), row(ANSWER)]))
    assert len(load_demonstrations(tmp_path / "demos.JSONL")) == 1
    assert len(load_demonstrations(tmp_path / "demos.Json")) == 2


def _run_dir(tmp_path, shards_json):
    """A run directory as rejection sampling reads it: config.yaml and one complete stage."""
    run = tmp_path / "run"
    stage = run / "stages" / "stage_000"
    stage.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(load_config(overrides=["model.name=some-model"])))
    (stage / "shards.json").write_text(shards_json)
    return load_config(overrides=["model.name=some-model", f"warmstart.data={run}"])


@pytest.mark.unit
@pytest.mark.parametrize("text,match", [
    ("garbage{", r"shards\.json cannot be read \(Expecting value"),
    ("[1, 2]", r"shards\.json cannot be read \(list indices"),
    ('{"num_shards": "two"}', r"shards\.json cannot be read \(invalid literal for int"),
    ('{"num_shards": 0}', r"shards\.json cannot be read \(it lists no shards \(num_shards=0\)\)"),
])
def test_a_garbage_shards_file_in_a_run_is_refused_naming_it(tmp_path, text, match):
    with pytest.raises(DemonstrationError, match=r"warmstart\.data=.*run: .*" + match):
        load_source(_run_dir(tmp_path, text))


@pytest.mark.unit
def test_a_run_whose_stage_lists_no_shards_is_not_advised_a_lower_min_reward(tmp_path):
    with pytest.raises(DemonstrationError, match=r"the run directory is damaged") as e:
        load_source(_run_dir(tmp_path, '{"num_shards": 0}'))
    assert "min_reward" not in str(e.value)
