"""``mugrpo eval``'s pure parts (mugrpo.evaluation.cli): the console table, and what ``--model`` names
when it is not a model."""
import math

import pytest

from mugrpo.evaluation.cli import _settings, format_table, resolve_model
from mugrpo.config.schema import Config
from mugrpo.errors import ConfigError, UserError


def _metrics(**scores):
    return {"num_items": 4, "response_len_mean": 12.5, "truncated_frac": 0.25, "tok_s": 123.4, "eval_s": 5.0,
            **scores}


@pytest.mark.unit
def test_format_table_one_task_orders_scores_and_writes_percent():
    results = {"math": _metrics(pass_at_4=0.75, greedy_acc=0.5, pass_at_1=0.625, avg_at_4=0.625)}
    lines = format_table(results, {}).splitlines()
    # greedy first, then avg@k, then pass@k by k; scores x 100 with one decimal
    assert lines[0].split() == ["task", "items", "greedy%", "avg@4%", "pass@1%", "pass@4%", "len", "trunc%",
                                "tok/s", "s"]
    assert lines[1] == "-" * len(lines[0])
    assert lines[2].split() == ["math", "4", "50.0", "62.5", "62.5", "75.0", "12.5", "25.0", "123", "5.0"]
    assert len(lines) == 3  # one task: no overall row


@pytest.mark.unit
def test_format_table_several_tasks_add_the_overall_row_and_dashes_for_missing_scores():
    results = {"a": _metrics(greedy_acc=1.0, pass_at_2=0.5), "bb": _metrics(greedy_acc=0.0)}
    # the overall is given by the caller (the macro mean): (1.0 + 0.0) / 2 = 0.5; pass@2 only from "a"
    lines = format_table(results, {"greedy_acc": 0.5, "pass_at_2": math.nan}).splitlines()
    assert lines[0].split()[:4] == ["task", "items", "greedy%", "pass@2%"]
    assert lines[3].split() == ["bb", "4", "0.0", "-", "12.5", "25.0", "123", "5.0"]  # no pass@2: "-"
    # items 4 + 4 = 8; a NaN score is "-"; the last four columns are blank
    assert lines[4].split() == ["overall", "(mean)", "8", "50.0", "-"]
    assert all(len(line) == len(lines[0]) for line in lines[2:4])  # columns aligned


@pytest.mark.unit
def test_format_table_shows_an_environments_reward_as_it_is():
    results = {"env": _metrics(greedy_reward_mean=-0.375, greedy_solved_frac=0.25)}
    lines = format_table(results, {}).splitlines()
    # The two columns' order is not asserted: both sort last among the scores (key (3, 0)) and come from a set,
    # so their order follows the string hash seed (see the report). Read each cell under its own label.
    cells = dict(zip(lines[0].split(), lines[2].split()))
    assert cells["reward"] == "-0.375"  # a reward of any scale as it is, 3 decimals
    assert cells["solved%"] == "25.0"  # a fraction in percent


def test_settings_refuse_n_below_the_largest_k():
    from types import SimpleNamespace

    args = SimpleNamespace(k="1,8", n=4, num_items=None, no_greedy=False, temperature=None, top_p=None,
                           max_new_tokens=None, seed=0, samples=None)
    with pytest.raises(ConfigError, match=r"--n 4 is smaller than the largest k \(8\)"):
        _settings(args, Config())
    args.n, args.k = None, "2,x"
    with pytest.raises(ConfigError, match=r"--k '2,x': expected comma-separated integers"):
        _settings(args, Config())


def test_a_folder_that_is_not_a_model_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match=r"exists but has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(UserError, match=r"does not exist"):
        resolve_model(str(tmp_path / "missing"))


def test_a_run_directory_without_config_or_final_model_says_what_to_pass(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match=r"a mugrpo run directory without its config.yaml; restore it"):
        resolve_model(str(run))
    (run / "config.yaml").write_text("preset: mu-grpo\n")
    with pytest.raises(UserError, match=r"the run has no final_model/ .* pass one of its checkpoints instead"):
        resolve_model(str(run))


@pytest.mark.unit
def test_environment_score_columns_keep_one_order():
    from mugrpo.evaluation.cli import ENV_SCORES, _score_order

    # sorted from a set in any order, the environment's scores come out in ENV_SCORES's order, after accuracy
    keys = ["sample_solved_frac", "greedy_reward_mean", "greedy_acc", "greedy_solved_frac", "sample_reward_mean"]
    assert sorted(keys, key=_score_order) == ["greedy_acc", *[k for k in ENV_SCORES if k in keys]]


def test_max_new_tokens_zero_is_refused_not_replaced():
    import argparse

    from mugrpo.config import load_config
    from mugrpo.evaluation.cli import _settings

    args = argparse.Namespace(k="1", n=None, max_new_tokens=0, temperature=None, no_greedy=False, num_items=None,
                              top_p=None, batch_size=None)
    with pytest.raises(ConfigError, match="eval.max_new_tokens=0 is out of range"):
        _settings(args, load_config())
