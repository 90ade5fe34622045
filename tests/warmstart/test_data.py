"""Loading demonstrations (mugrpo.warmstart.data): the formats, the sources, and every refusal,
each naming the row and what is wrong."""

import json

import pytest

from mugrpo.config import TaskConfig
from mugrpo.rollout.envs.builtin import calculate
from mugrpo.rollout.envs.tools import tool_schemas
from mugrpo.warmstart.data import DemonstrationError, load_demonstrations, tool_call_text

pytestmark = pytest.mark.unit

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def call(arguments, name="calculate"):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_row(arguments=None, tools=None):
    row = {"messages": [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "6 * 7?"},
        {"role": "assistant", "content": None, "tool_calls": [call(arguments or {"expression": "6 * 7"})]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "\\boxed{42}"},
        {"role": "user", "content": "thanks"}]}  # after the last assistant message: dropped
    if tools is not None:
        row["tools"] = tools
    return row


def test_a_conversation_with_a_tool_call_becomes_prompt_and_policy_turns():
    (demo,) = load_demonstrations([tool_row()], tools=[calculate])
    assert demo.index == 0 and demo.tools == [calculate]
    assert demo.prompt == [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "6 * 7?"}]
    first, final = demo.turns
    # The call, written as the model writes it; its reply gets the call's name; the turn stops at </tool_call>.
    assert (first.text, first.calls_tool, first.train) == (CALL, True, True)
    assert first.env == [{"role": "tool", "content": "42", "name": "calculate"}]
    assert (final.text, final.calls_tool, final.env) == ("\\boxed{42}", False, [])  # "thanks" is dropped


def test_content_before_a_call_and_json_string_arguments():
    row = tool_row('{"expression": "6 * 7"}', tools=tool_schemas([calculate]))
    row["messages"][2]["content"] = "Let me compute."
    (demo,) = load_demonstrations([row])
    assert demo.turns[0].text == "Let me compute.\n" + CALL  # Qwen's layout: a newline before the block
    assert demo.tools == tool_schemas([calculate])  # the row's tools column, as schemas


def test_a_call_written_in_the_content_is_parsed_like_a_structured_one():
    row = tool_row()
    row["messages"][2] = {"role": "assistant", "content": CALL}
    (demo,) = load_demonstrations([row], tools=[calculate])
    assert (demo.turns[0].text, demo.turns[0].calls_tool) == (CALL, True)


def test_prompt_completion_rows():
    strings = load_demonstrations([{"prompt": "2+2?", "completion": "4"}])[0]
    assert strings.prompt == [{"role": "user", "content": "2+2?"}] and strings.turns[0].text == "4"
    cfg = TaskConfig(instruction="Box it.", few_shot=[], system_prompt="Be exact.")
    as_task = load_demonstrations([{"prompt": "2+2?", "completion": "4"}], task_cfg=cfg)[0]
    assert as_task.prompt == [{"role": "system", "content": "Be exact."},
                              {"role": "user", "content": "2+2?\n\nBox it."}]
    lists = load_demonstrations([{"prompt": [{"role": "user", "content": "2+2?"}],
                                  "completion": [{"role": "assistant", "content": "4"}]}])[0]
    assert lists.prompt == strings.prompt and lists.turns == strings.turns


def test_the_train_flag_leaves_an_assistant_turn_out():
    row = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5", "train": False},
                        {"role": "user", "content": "No."}, {"role": "assistant", "content": "4", "train": True}]}
    (demo,) = load_demonstrations([row])
    assert [t.train for t in demo.turns] == [False, True]
    assert demo.turns[0].env == [{"role": "user", "content": "No."}]


def test_parallel_calls_are_split_one_per_turn_on_request():
    row = {"messages": [{"role": "user", "content": "6 * 7 and 3 + 4?"},
                        {"role": "assistant", "content": "Both.", "train": False,
                         "tool_calls": [call({"expression": "6 * 7"}), call({"expression": "3 + 4"})]},
                        {"role": "tool", "content": "42"}, {"role": "tool", "content": "7"},
                        {"role": "assistant", "content": "42 and 7"}]}
    with pytest.raises(DemonstrationError, match="row 0: message 1 makes 2 tool calls"):
        load_demonstrations([row], tools=[calculate])
    (demo,) = load_demonstrations([row], tools=[calculate], split_calls=True)
    first, second, final = demo.turns
    # the content stays with the first call; each call is followed by its own reply; the flag is kept
    assert (first.text, first.env, first.train) == ("Both.\n" + CALL, [{"role": "tool", "content": "42",
                                                                        "name": "calculate"}], False)
    assert second.text == tool_call_text("calculate", {"expression": "3 + 4"}) and second.env[0]["content"] == "7"
    assert (second.train, final.text) == (False, "42 and 7")
    row["messages"].pop(3)  # one reply for two calls
    with pytest.raises(DemonstrationError, match="row 0: message 1 makes 2 tool calls but is not followed by 2"):
        load_demonstrations([row], tools=[calculate], split_calls=True)


def test_files_and_datasets_give_the_same_demonstrations(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [tool_row('{"expression": "6 * 7"}', tools=[json.dumps(s) for s in tool_schemas([calculate])]),
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    expected = load_demonstrations(rows)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")  # Arrow fills missing keys with None
    for source in ("d.jsonl", "d.json", "d.parquet"):
        assert load_demonstrations(tmp_path / source) == expected, source
    assert load_demonstrations(datasets.Dataset.from_list(rows)) == expected


def good():
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def messages(*ms):
    return {"messages": list(ms)}


U, A = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
BAD = [
    (messages(U, {"role": "bot", "content": "a"}), r"row 1: message 1 has role 'bot'"),
    (messages(U, {"content": "a"}), r"row 1: message 1 has no role"),
    (messages(U, A, "no"), r"row 1: message 2 has no role"),
    (messages(U, {"role": "assistant", "tool_calls": [call("{expression: 6*7")]}),
     r"row 1: message 1: the arguments of tool call 'calculate': a string that is not JSON"),
    (messages(U, {"role": "assistant", "tool_calls": [call({"expression": "1"}, name="search")]}),
     r"row 1: message 1 calls tool 'search', which is not among the tools \['calculate'\]"),
    (messages(U, {"role": "assistant", "tool_calls": [call({"expr": "1"})]}), r"row 1: message 1: .* do not fit"),
    (messages(U, {"role": "assistant", "content": "<tool_call>\nnot json\n</tool_call>"}),
     r"row 1: message 1 has a tool call the rollout loop cannot parse"),
    (messages(U, {"role": "assistant", "tool_calls": [call({"expression": "1"}), call({"expression": "2"})]}),
     r"row 1: message 1 makes 2 tool calls"),
    (messages(U, {"role": "assistant", "content": CALL + " then"}),
     r"row 1: message 1 has text after its </tool_call>"),
    (messages(U, {"role": "user", "content": "more"}), r"row 1 has no assistant message"),
    (messages(A, U, A), r"row 1 starts with an assistant message"),
    (messages(U, A, A), r"row 1: messages 1 and 2 are both assistant"),
    (messages(U, {**A, "train": False}), r"row 1: every assistant message has train=false"),
    (messages(U, {**A, "train": "yes"}), r"row 1: message 1 has train='yes'"),
    (messages({**U, "train": True}, A), r"row 1: message 0 \(user\) has train=true"),
    (messages(U, {"role": "system", "content": "s"}, A), r"row 1: message 1 is a system message"),
    (messages({"role": "user", "content": [{"type": "text", "text": "q"}]}, A),
     r"row 1: message 0 \(user\) has content"),
    ({"text": "The sky is blue."}, r"row 1 is plain text"),
    ({"question": "q"}, r"row 1 has neither 'messages' nor 'prompt' and 'completion' \(its keys: \['question'\]\)"),
    ({**good(), "tools": "[{not json"}, r"row 1: the tools column: a string that is not JSON"),
    ({**good(), "tools": [{"name": "f"}]}, r"row 1: a tool must be a JSON schema"),
]


@pytest.mark.parametrize("row, match", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_rows_are_refused_with_their_index_and_reason(row, match):
    with pytest.raises(DemonstrationError, match=match):
        load_demonstrations([good(), row], tools=[calculate])


def test_empty_and_unreadable_sources_are_refused(tmp_path):
    with pytest.raises(DemonstrationError, match="the dataset is empty"):
        load_demonstrations([])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DemonstrationError, match="empty.jsonl: the dataset is empty"):
        load_demonstrations(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(good()) + "\n{oops\n")
    with pytest.raises(DemonstrationError, match="bad.jsonl, line 2: not JSON"):
        load_demonstrations(tmp_path / "bad.jsonl")
    with pytest.raises(DemonstrationError, match="does not exist"):
        load_demonstrations(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a\n")
    with pytest.raises(DemonstrationError, match="read from .jsonl, .json or .parquet"):
        load_demonstrations(tmp_path / "d.csv")


def test_tool_call_text_is_what_the_rollout_parser_reads():
    from mugrpo.rollout.envs.tools import parse_tool_calls

    (parsed,) = parse_tool_calls(tool_call_text("calculate", {"expression": "6 * 7"}))
    assert (parsed.name, parsed.arguments, parsed.error) == ("calculate", {"expression": "6 * 7"}, None)
    assert tool_call_text("calculate", {"expression": "6 * 7"}) == CALL
