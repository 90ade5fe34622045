"""mugrpo.cli: ``mugrpo plan`` reads the built-in model's
tokenizer for an environment run, ``key=value`` overrides are accepted anywhere on the line, and a verb's
code is imported only when that verb runs."""
import shutil
import subprocess
import sys

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


def _imported_modules(*argv: str) -> set[str]:
    """The modules ``python -X importtime -m mugrpo ARGV`` imports (its stderr lists each one)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "mugrpo", *argv], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}


VERB_MODULES = ("mugrpo.serve", "mugrpo.observability.report", "mugrpo.evaluation.cli")


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["sft", "--help"]])
def test_help_imports_no_other_verbs_code(argv):
    imported = _imported_modules(*argv)
    assert "mugrpo.cli" in imported  # the listing is read: the command's own module is in it
    assert not imported & set(VERB_MODULES), sorted(imported & set(VERB_MODULES))
    if argv == ["--help"]:
        assert "mugrpo.config" not in imported  # no verb's arguments are built for the verb list


@pytest.mark.unit
def test_a_verbs_arguments_are_loaded_when_its_verb_is_parsed():
    parser = build_parser()
    assert not any(a.option_strings for a in parser.verb_parsers["report"]._actions if a.dest != "help")
    args = parse_args(parser, ["report", "r1", "--out", "o"])
    assert args.out == "o" and getattr(parser.verb_parsers["report"], "loaded", False)
    assert not getattr(parser.verb_parsers["serve"], "loaded", False)
