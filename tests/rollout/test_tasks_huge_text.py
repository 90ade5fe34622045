"""Hostile dataset files and rows refused with a message, before a JSON reader or a tokenizer sees them
(mugrpo.rollout.tasks)."""

import json

import pytest

from mugrpo.config import load_config
from mugrpo.rollout.tasks import MAX_JSON_DEPTH, TaskError, items_from_rows, load_rows


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deeply_nested_json_is_refused_before_it_is_read(tmp_path, suffix):
    # 20000 levels crashed pyarrow's reader (a segfault); 2000 raised RecursionError from Python's.
    deep = '{"question": "q", "answer": "1", "x": ' + "[" * 20000 + "]" * 20000 + "}"
    path = tmp_path / f"deep{suffix}"
    path.write_text(deep + "\n" if suffix == ".jsonl" else f"[{deep}]")
    with pytest.raises(TaskError, match=rf"nests arrays or objects 2000[12] levels deep \(at most {MAX_JSON_DEPTH}"):
        load_rows(str(path))


def test_brackets_inside_strings_do_not_count_as_nesting(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"question": "[" * 500 + '\\" {', "answer": "1"}) + "\n")
    assert load_rows(str(path))[0]["answer"] == "1"


@pytest.mark.unit
def test_a_lone_surrogate_in_a_prompt_is_refused_at_load():
    rows = [{"question": "fine", "answer": "1"}, {"question": json.loads('"a \\udc80"'), "answer": "2"}]
    with pytest.raises(TaskError, match=r"train_dataset, row 1: the prompt holds a lone surrogate '\\udc80' at "
                                        r"character 2"):
        items_from_rows(rows, load_config().task, "train_dataset")
