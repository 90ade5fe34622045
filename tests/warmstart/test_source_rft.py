"""Rejection-sampling fine-tuning wired in (warmstart.data = an earlier run's directory), and the warm start
in `mugrpo plan` and `mugrpo report`.

One RL run of the tiny model that starts with a warm start on "11111" demonstrations (so its sampled
responses often end by themselves, and score frac_ones = 1): its RUN_DIR/warmstart/ sub-run is what the
report shows, its stages are what rejection sampling selects from."""
import json
import math

import pytest
from warmstart.test_phase import DEMO_ROWS, SFT_KEYS, _mugrpo, _write

from conftest import TINY_OVERRIDES
from mugrpo.config import ConfigError, load_config
from mugrpo.observability.loggers import read_metrics
from mugrpo.run_dir import SHARDS_FILE, RunDir, shard_path
from mugrpo.stages.data import StageData

RL_KEYS = [*TINY_OVERRIDES, *SFT_KEYS, "warmstart.epochs=4", "schedule.total_updates=2", "schedule.num_stages=2",
           "schedule.prompts_per_update=4", "rollout.group_size=4", "eval.num_items=0"]


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("demos") / "demos.jsonl", DEMO_ROWS)


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory, tiny_model_dir, demos):
    run_dir = tmp_path_factory.mktemp("rl") / "run"
    r = _mugrpo("train", "--run-dir", run_dir, f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *RL_KEYS)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _stored(run_dir, min_reward):
    """Counted from the stage store directly: (trajectories read, those kept, their response tokens)."""
    total, kept, tokens = 0, 0, 0
    for folder in sorted(RunDir(run_dir).stages.glob("stage_*")):
        for shard in range(json.loads((folder / SHARDS_FILE).read_text())["num_shards"]):
            data = StageData.load(shard_path(folder, shard))
            for s, response in enumerate(data.responses):
                total += 1
                if float(data.rewards[s]) >= min_reward and bool(data.finished[s]):
                    kept, tokens = kept + 1, tokens + len(response)
    return total, kept, tokens


@pytest.mark.slow  # ~22 s
def test_rejection_sampling_from_a_run(rl_run, tiny_model_dir, tmp_path):
    total, kept, tokens = _stored(rl_run, 1.0)
    assert total == 32  # 2 stages x 4 prompts x G = 4
    assert 0 < kept < total, "the warm-started model should sample some, not all, perfect finished responses"
    out = tmp_path / "rft"
    r = _mugrpo("sft", "--run-dir", out, f"model.name={tiny_model_dir}", f"warmstart.data={rl_run}",
                "warmstart.min_reward=1.0", *SFT_KEYS, "warmstart.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"kept {kept} of 32 trajectories from 2 complete stage(s)" in r.stdout
    data = next(x for x in read_metrics(out / "metrics.jsonl") if x["kind"] == "sft_data")
    # single-turn trajectories: every response token is a policy token, so all of them are trained
    assert (data["num_demonstrations"], data["num_total"], data["num_stages"]) == (kept, 32, 2)
    assert (data["num_loss_tokens"], data["num_dropped"], data["num_steps"]) == (tokens, 0, 2)
    assert (out / "final_model" / "config.json").is_file()


def test_a_lower_threshold_keeps_more(rl_run, tiny_model_dir):
    from mugrpo.warmstart.source import load_source

    # the source run's own starting model (its warm start's final model) is accepted as model.name too
    cfg = load_config(overrides=[f"model.name={rl_run / 'warmstart' / 'final_model'}", f"warmstart.data={rl_run}",
                                 "warmstart.min_reward=0.5"])
    source = load_source(cfg)
    assert len(source) == _stored(rl_run, 0.5)[1] >= _stored(rl_run, 1.0)[1]
    assert source.selection["reward_max"] == pytest.approx(1.0)


def test_rejection_sampling_of_another_model_exits_2(rl_run, tmp_path):
    r = _mugrpo("sft", "--run-dir", tmp_path / "run", "model.name=/elsewhere/model", f"warmstart.data={rl_run}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "model.name='/elsewhere/model'" in r.stderr and "sampled from" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_an_empty_selection_exits_2(rl_run, tiny_model_dir, tmp_path):
    r = _mugrpo("sft", "--run-dir", tmp_path / "run", f"model.name={tiny_model_dir}", f"warmstart.data={rl_run}",
                "warmstart.min_reward=1.5")  # frac_ones is at most 1
    assert r.returncode == 2, r.stderr[-3000:]
    assert "warmstart.min_reward=1.5" in r.stderr and "32 read from 2 stage(s), the best reward 1" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_a_folder_that_is_not_a_run_exits_2(tiny_model_dir, tmp_path):
    r = _mugrpo("sft", "--run-dir", tmp_path / "run", f"model.name={tiny_model_dir}", f"warmstart.data={tmp_path}")
    assert r.returncode == 2 and "without config.yaml" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_min_reward_must_be_finite(value):
    with pytest.raises(ConfigError, match=r"warmstart\.min_reward"):
        load_config(overrides=[f"warmstart.min_reward={value}"])


def test_plan_shows_the_rejection_sampled_warm_start(rl_run, tiny_model_dir):
    _, kept, tokens = _stored(rl_run, 1.0)
    r = _mugrpo("plan", f"model.name={tiny_model_dir}", f"warmstart.data={rl_run}", "warmstart.batch_size=2",
                "warmstart.epochs=3", "warmstart.lr=0.001")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"kept {kept} of 32 trajectories" in r.stdout
    assert f"{tokens} trained a pass; 0 cut" in r.stdout
    steps = 3 * math.ceil(kept / 2)  # 3 epochs of ceil(kept / batch_size 2) steps
    assert any(line.split() == ["warm", "start", "steps", str(steps)] for line in r.stdout.splitlines())
    assert "lr=0.001" in r.stdout and "batch_size=2, 3 epoch(s)" in r.stdout


def test_report_shows_the_warm_start_of_an_rl_run(rl_run, tmp_path):
    steps = [x for x in read_metrics(rl_run / "warmstart" / "metrics.jsonl") if x["kind"] == "sft"]
    assert len(steps) == 12  # 4 epochs x ceil(6 / 2)
    r = _mugrpo("report", rl_run, "--out", tmp_path / "report", "--labels", "rl")
    assert r.returncode == 0, r.stderr[-3000:]
    warm = json.loads((tmp_path / "report" / "summary.json").read_text())["warmstart"]["rl"]
    assert warm["num_steps"] == 12 and warm["num_demonstrations"] == 6
    assert warm["loss_first"] == steps[0]["sft/loss"] and warm["loss_last"] == steps[-1]["sft/loss"]
    assert warm["num_tokens"] == 12 * 2 * 6  # 12 steps x 2 demonstrations x ("11111" + EOS)
    assert warm["wall_s"] == steps[-1]["time_s"]
    md = (tmp_path / "report" / "summary.md").read_text()
    section = md[md.index("## Warm start"):]
    row = next(line for line in section.splitlines() if line.startswith("| rl |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:8] == ["6", "12", f"{steps[0]['sft/loss']:.4f}", f"{steps[-1]['sft/loss']:.4f}", "144", "0"]


@pytest.mark.slow  # ~14 s
def test_report_shows_a_warm_start_only_run(rl_run, tiny_model_dir, tmp_path):
    out = tmp_path / "sft"
    r = _mugrpo("sft", "--run-dir", out, f"model.name={tiny_model_dir}", f"warmstart.data={rl_run}",
                *SFT_KEYS, "warmstart.steps=3")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x for x in read_metrics(out / "metrics.jsonl") if x["kind"] == "sft"]
    r = _mugrpo("report", out, "--out", tmp_path / "report")
    assert r.returncode == 0, r.stderr[-3000:]
    warm = json.loads((tmp_path / "report" / "summary.json").read_text())["warmstart"]["sft"]
    assert (warm["num_steps"], warm["loss_first"], warm["loss_last"]) == (3, steps[0]["sft/loss"], steps[2]["sft/loss"])
    assert warm["num_tokens"] == sum(x["sft/num_tokens"] for x in steps) and warm["data"] == str(rl_run)
    assert warm["num_total"] == 32 and warm["num_stages"] == 2


def test_a_damaged_shard_of_the_source_exits_2_naming_it(rl_run, tiny_model_dir, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(rl_run, source)
    shard = shard_path(RunDir(source).stage(1), 0)
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # one flipped bit in the tensors' bytes: the file still parses, the checksum differs
    shard.write_bytes(bytes(raw))
    r = _mugrpo("sft", "--run-dir", tmp_path / "run", f"model.name={tiny_model_dir}", f"warmstart.data={source}",
                *SFT_KEYS, "warmstart.steps=1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(shard) in r.stderr and "sha256" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()
