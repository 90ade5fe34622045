"""mugrpo.cli: ``mugrpo plan`` reads the built-in model's
tokenizer for an environment run, and ``key=value`` overrides are accepted anywhere on the line."""
import shutil

import pytest

from mugrpo.cli import build_parser, main, parse_args


def test_plan_of_a_tool_run_reads_the_built_in_models_tokenizer(tmp_path, tiny_model_dir, monkeypatch, capsys):
    # The built-in name resolves to MUGRPO_CACHE/models/<name> once converted: here a copy of the tiny model.
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "smollm2-135m-instruct")
    monkeypatch.setenv("MUGRPO_CACHE", str(tmp_path))
    assert main(["plan", "model.name=smollm2-135m-instruct", "task.env=calculator",
                 "rollout.max_new_tokens=100"]) == 0
    out = capsys.readouterr().out
    assert "did not load" not in out and "tokens per environment turn" in out


@pytest.mark.unit
@pytest.mark.parametrize("argv", [
    ["train", "--run-dir", "R", "a.b=1", "c=2"],
    ["train", "a.b=1", "--run-dir", "R", "c=2"],
    ["train", "a.b=1", "c=2", "--run-dir", "R"],
    ["train", "--preset", "grpo", "a.b=1", "--run-dir", "R", "c=2"],
])
def test_overrides_are_accepted_before_between_and_after_flags(argv):
    args = parse_args(build_parser(), argv)
    assert args.run_dir == "R" and args.overrides == ["a.b=1", "c=2"]


@pytest.mark.unit
def test_overrides_after_flags_in_every_verb_that_takes_them():
    parser = build_parser()
    assert parse_args(parser, ["sft", "--run-dir", "R", "x=1", "--resume", "R", "y=2"]).overrides == ["x=1", "y=2"]
    assert parse_args(parser, ["plan", "x=1", "--preset", "grpo", "y=2"]).overrides == ["x=1", "y=2"]
    assert parse_args(parser, ["config", "x=1", "--reference", "y=2"]).overrides == ["x=1", "y=2"]
    args = parse_args(parser, ["eval", "--model", "M", "x=1", "--task", "t", "y=2=3"])
    assert args.overrides == ["x=1", "y=2=3"] and args.task == ["t"]


@pytest.mark.unit
@pytest.mark.parametrize("argv, stray", [
    (["train", "--run-dir", "R", "c=2", "--bogus"], "--bogus"),
    (["train", "c=2", "--run-dir", "R", "=3"], "=3"),
    (["report", "r1", "--out", "o", "x=1"], "x=1"),  # report takes no overrides
])
def test_a_token_that_is_neither_a_flag_nor_an_override_is_an_error(argv, stray, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(build_parser(), argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {stray}" in capsys.readouterr().err


def test_a_stray_word_in_the_override_block_is_named_with_the_fix(capsys):
    assert main(["plan", "schedule.total_updates=8", "oops", "--preset", "grpo"]) == 2
    assert "override 'oops' is not of the form key=value" in capsys.readouterr().err
