"""Demonstrations cut by characters before they are tokenized (mugrpo.warmstart.render): the example
kept is the one the token rule keeps from the whole text, the cuts are counted, and a 10 MB message
keeps a warm start of the tiny model under 1 GB."""

import json
import sys

import pytest
from memory_peak import peak_rss_kib
from warmstart.test_phase import SFT_KEYS

from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.warmstart.data import load_demonstrations
from mugrpo.warmstart.render import render_demonstration, render_demonstrations, truncate


def rows(answer, question="q"):
    return [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}]


def test_a_cut_message_gives_the_example_the_whole_one_gives():
    tiny = build_char_tokenizer()
    long = load_demonstrations(rows("1" * 5000))
    # max_length 40 keeps 40 * 5 + 1 = 201 characters of a text (5: the longest tiny token)
    whole = truncate(render_demonstration(tiny, long[0]), 40)
    examples, counts = render_demonstrations(tiny, long, 40)
    assert examples == [whole] and len(whole.input_ids) == 40 and sum(whole.response_mask) == 40 - 6  # "u:q\na:"
    assert (counts["num_cut_texts"], counts["num_truncated"]) == (1, 1)


def test_a_cut_prompt_is_dropped_as_the_whole_one_is():
    tiny = build_char_tokenizer()
    demos = load_demonstrations(rows("fine", question="?" * 5000) + rows("ok"))
    examples, counts = render_demonstrations(tiny, demos, 40)
    assert [e.source for e in examples] == [1]
    assert (counts["num_cut_texts"], counts["num_dropped"]) == (1, 1)


@pytest.mark.parametrize("role", [pytest.param("user", marks=pytest.mark.slow), "assistant"])
def test_a_10_mb_message_keeps_a_warm_start_under_1_gb(tiny_model_dir, tmp_path, role):
    big = "1" * 10_000_000
    row = {"messages": [{"role": "user", "content": big if role == "user" else "q"},
                        {"role": "assistant", "content": big if role == "assistant" else "11"}]}
    small = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "11"}]}
    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps(row) + "\n" + json.dumps(small) + "\n")
    code, kib, out = peak_rss_kib([sys.executable, "-m", "mugrpo", "sft", "--run-dir", tmp_path / "run",
                                   f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *SFT_KEYS,
                                   "warmstart.steps=1"])
    assert code == 0, out
    assert "1 texts cut by characters before tokenizing" in out
    assert kib < 1024 * 1024, f"peak RSS {kib / 1024:.0f} MiB"  # over 4 GB before the cut
