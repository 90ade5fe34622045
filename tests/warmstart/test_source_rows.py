"""Demonstrations given from Python to mugrpo.sft (a datasets.Dataset, a list of rows): trained as the same
rows from a file, recorded in config.yaml as python:N rows; and `mugrpo plan` on a demonstrations file."""
import pytest
import yaml
from warmstart.test_phase import DEMO_ROWS, SFT_KEYS, _mugrpo, _write

from mugrpo.config import ConfigError, parse_override


def _sft(tiny_model_dir, data, run_dir):
    import mugrpo

    keys = dict(parse_override(k) for k in SFT_KEYS)
    return mugrpo.sft({"model.name": tiny_model_dir, **keys, "warmstart.steps": 3}, data=data, run_dir=run_dir)


def test_rows_and_a_dataset_train_as_the_same_rows_from_a_file(tiny_model_dir, tmp_path):
    import datasets

    from_file = _sft(tiny_model_dir, _write(tmp_path / "demos.jsonl", DEMO_ROWS), tmp_path / "file")
    from_list = _sft(tiny_model_dir, [dict(r) for r in DEMO_ROWS], tmp_path / "list")
    from_dataset = _sft(tiny_model_dir, datasets.Dataset.from_list(DEMO_ROWS), tmp_path / "dataset")
    losses = [[r["sft/loss"] for r in result.metrics("sft")] for result in (from_file, from_list, from_dataset)]
    assert len(losses[0]) == 3 and losses[0][0] != losses[0][-1]  # it trains
    # the same rows in the same seeded order: the same losses, bit for bit (train.deterministic=true, CPU)
    assert losses[1] == losses[0] and losses[2] == losses[0]
    assert [r["sft/num_tokens"] for r in from_list.metrics("sft")] == [12.0] * 3  # 2 rows x ("11111" + EOS)
    recorded = [yaml.safe_load((r.run_dir / "config.yaml").read_text())["warmstart"]["data"]
                for r in (from_list, from_dataset)]
    assert recorded[0] == recorded[1] and recorded[0].startswith("python:6 rows, sha256 ")
    # a resume needs the same rows again
    import mugrpo

    with pytest.raises(ConfigError, match="the same rows as data="):
        mugrpo.sft(run_dir=from_list.run_dir, resume=True)
    with pytest.raises(ConfigError, match="the same rows as data="):
        mugrpo.sft(run_dir=from_list.run_dir, resume=True, data=DEMO_ROWS[:5])


def test_a_python_label_without_its_rows_exits_2(tiny_model_dir, tmp_path):
    r = _mugrpo("sft", "--run-dir", tmp_path / "run", f"model.name={tiny_model_dir}",
                "warmstart.data=python:6 rows, sha256 0123456789abcdef")
    assert r.returncode == 2 and "warmstart.data='python:6 rows" in r.stderr and "Traceback" not in r.stderr


def test_plan_shows_a_warm_start_on_demonstrations(tiny_model_dir, tmp_path, capsys):
    from mugrpo.cli import main

    demos = _write(tmp_path / "demos.jsonl", DEMO_ROWS)
    def plan(*keys):  # in this process: the command's own code, without a start-up per call
        rc = main(["plan", f"model.name={tiny_model_dir}", f"warmstart.data={demos}", "warmstart.batch_size=4",
                   "warmstart.epochs=2", "warmstart.lr=0.01", *keys])
        out, err = capsys.readouterr()
        assert rc == 0, err[-3000:]
        assert f"6 demonstrations from {demos}" in out
        return {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines()
                if line.startswith("warm start")}

    lines = plan()
    # 6 rows x ("11111" + EOS) = 36 trained tokens, none cut; 2 epochs x ceil(6 / 4) = 4 steps
    assert lines["warm start tokens"] == "36 trained a pass; 0 cut to max_length=1024, 0 dropped"
    assert lines["warm start steps"] == "4"
    assert lines["warm start optimizer"] == "lr=0.01 (schedule constant, no warmup), batch_size=4, 2 epoch(s)"
    # The tiny template's prompt "u:q0\na:" is 7 tokens: max_length=10 leaves 3 of each row's 6 trained tokens
    assert plan("warmstart.max_length=10")["warm start tokens"] == "18 trained a pass; 6 cut to max_length=10, 0 dropped"
    # max_length=7: the prompt alone; every row dropped
    lines = plan("warmstart.max_length=7")
    assert lines["warm start tokens"] == "0 trained a pass; 0 cut to max_length=7, 6 dropped"
    assert lines["warm start steps"].startswith("none: every example dropped")


def test_plan_refuses_bad_demonstrations(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    r = _mugrpo("plan", f"model.name={tiny_model_dir}", f"warmstart.data={bad}")
    assert r.returncode == 2 and "row 0" in r.stderr and "Traceback" not in r.stderr
