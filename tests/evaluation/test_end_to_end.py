"""End to end on tiny runs: evaluation during training, ``mugrpo eval`` and ``mugrpo report``.

Three tiny runs (a 0.1M-parameter character model, reward = fraction of "1"s, about 10 s each on
an idle 2-core machine) are trained once for the module: mu-grpo (3 stages of 2 updates) with
evaluation at several cadences, the same run with evaluation off, and grpo (2 stages of mu = 4).
"""

import json
import math
import re

import pytest
import torch

from mugrpo.cli import main
from mugrpo.observability.loggers import read_metrics
from mugrpo.models.tiny import build_tiny_model

TINY = ["task.reward_fn=ones_reward:reward", "task.few_shot=[]", "task.instruction=", "task.size=200",
        "rollout.max_new_tokens=8", "rollout.group_size=4", "schedule.prompts_per_update=4",
        "schedule.total_updates=8", "optim.lr=3e-3", "train.progress=false"]
EVAL = ["eval.num_items=8", "eval.k=2"]  # the old name of eval.num_samples, still accepted
MU = ["schedule.total_updates=6", "schedule.num_stages=3"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A model this small gains nothing from a second thread, and on a busy 2-core machine two
    # spinning OpenMP threads made these runs 2-3x slower (measured: 18 s vs 48 s wall per run).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("eval_e2e")
    model = build_tiny_model(root / "tiny")
    specs = {
        # 3 stages of 2 updates; eval at start, every 3 updates, at the end of stage 1 and the last.
        "mu": ("mu-grpo", [*MU, *EVAL, "eval.every_stages=2", "eval.every_updates=3"]),
        "mu_noeval": ("mu-grpo", [*MU, "eval.num_items=0"]),
        "grpo": ("grpo", EVAL),  # 2 stages of 4 updates; eval at start and at each stage end
    }
    out = {}
    for name, (preset, extra) in specs.items():
        run_dir = root / name
        assert main(["train", "--preset", preset, "--run-dir", str(run_dir), f"model.name={model}", *TINY, *extra]) == 0
        out[name] = run_dir
    return out


def _kind(run_dir, kind):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


def test_eval_records_follow_the_configured_cadence(runs):
    evals = _kind(runs["mu"], "eval")
    # at_start -> 0; every_updates=3 -> 3, 6; every_stages=2 -> end of stage 1 (update 4) and the last (6)
    assert [e["update"] for e in evals] == [0, 3, 4, 6]
    for e in evals:
        assert e["eval/num_items"] == 8
        assert {"eval/greedy_acc", "eval/avg_at_2", "eval/pass_at_1", "eval/pass_at_2"} <= set(e)
        assert 0 <= e["eval/pass_at_1"] <= e["eval/pass_at_2"] <= 1  # pass@k grows with k
    # Each stage's perf/eval_s is the time of the evaluations run during it (stage 0: the baseline).
    stages = _kind(runs["mu"], "stage")
    for s in stages:
        spent = sum(e["perf/eval_s"] for e in evals if e["stage"] == s["stage"])
        assert s["perf/eval_s"] == pytest.approx(spent)
    assert [s["perf/eval_s"] > 0 for s in stages] == [True, True, True]  # 0 / 3, 4 / 6
    assert [e["update"] for e in _kind(runs["grpo"], "eval")] == [0, 4, 8]
    assert all(s["perf/eval_s"] == 0.0 for s in _kind(runs["mu_noeval"], "stage"))


def test_evaluating_does_not_change_the_training_run(runs):
    with_eval, without = _kind(runs["mu"], "update"), _kind(runs["mu_noeval"], "update")
    assert len(with_eval) == len(without) == 6
    for a, b in zip(with_eval, without):
        for key in ("loss/policy", "loss/ratio_mean_neg", "optim/grad_norm"):
            assert a[key] == b[key], (a["update"], key)
    rewards = [[s["reward/mean"] for s in _kind(runs[name], "stage")] for name in ("mu", "mu_noeval")]
    assert rewards[0] == rewards[1]
    assert rewards[0][-1] > rewards[0][0]  # and the tiny run does learn


def _eval_cli(tmp_path, capsys, model, name, extra=()):
    out, samples = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
    rc = main(["eval", "--model", str(model), "--task", "train", "--k", "2", "--num-items", "6",
               "--out", str(out), "--samples", str(samples), *extra])
    assert rc == 0, capsys.readouterr().err
    return json.loads(out.read_text()), [json.loads(line) for line in samples.read_text().splitlines()]


def test_eval_cli_numbers_match_the_scored_responses(runs, tmp_path, capsys):
    result, samples = _eval_cli(tmp_path, capsys, runs["mu"], "final")
    assert result["model_path"] == str(runs["mu"] / "final_model")
    m = result["tasks"]["train"]
    greedy = [s["score"] for s in samples if s["mode"] == "greedy"]
    sampled = [s for s in samples if s["mode"] == "sample"]
    assert len(greedy) == 6 and len(sampled) == 12  # 6 items, n = 2
    assert m["greedy_acc"] == pytest.approx(sum(greedy) / 6)
    assert m["avg_at_2"] == pytest.approx(sum(s["score"] for s in sampled) / 12)
    # n = k = 2: pass@2 is the fraction of items with at least one full-credit sample
    solved = {s["item"] for s in sampled if s["score"] >= 1.0}
    assert m["pass_at_2"] == pytest.approx(len(solved) / 6)
    assert result["overall"]["greedy_acc"] == m["greedy_acc"]  # one task: overall is that task
    table = capsys.readouterr().out
    assert "greedy%" in table and "pass@2%" in table and f"{100 * m['greedy_acc']:.1f}" in table


def test_eval_cli_on_a_checkpoint_pushes_its_weights(runs, tmp_path, capsys):
    # The newest checkpoint is the run's end state: the same weights as final_model, loaded through
    # the engine's load_weights into the base model. Greedy texts must match exactly.
    ckpt = sorted((runs["mu"] / "checkpoints").glob("ckpt_*"))[-1]
    _, from_final = _eval_cli(tmp_path, capsys, runs["mu"], "final")
    _, from_ckpt = _eval_cli(tmp_path, capsys, ckpt, "ckpt")
    greedy = [[s["text"] for s in rows if s["mode"] == "greedy"] for rows in (from_final, from_ckpt)]
    assert greedy[0] == greedy[1]
    _, base = _eval_cli(tmp_path, capsys, runs["mu"] / ".." / "tiny", "base",
                        ["task.reward_fn=ones_reward:reward", "task.few_shot=[]", "task.instruction="])
    assert [s["text"] for s in base if s["mode"] == "greedy"] != greedy[0]  # training did change them


def test_eval_cli_user_errors_exit_2(runs, capsys):
    assert main(["eval", "--model", str(runs["mu"]), "--task", "nonsense"]) == 2
    assert "not understood" in capsys.readouterr().err
    assert main(["eval", "--model", str(runs["mu"]), "--k", "4", "--n", "2"]) == 2
    assert "n >= k" in capsys.readouterr().err
    assert main(["eval", "--model", str(runs["mu"]), "optim.lr=1"]) == 2
    assert "task.*, env.*, rollout.*" in capsys.readouterr().err
    # prompt budget + new tokens past the tiny model's 1,024 positions: refused before the engine starts
    assert main(["eval", "--model", str(runs["mu"]), "--max-new-tokens", "4000"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens=4000" in err and "max_position_embeddings=1024" in err
    try:  # the vllm case needs vllm to be absent
        import vllm  # noqa: F401
    except ImportError:
        assert main(["eval", "--model", str(runs["mu"]), "--engine", "vllm", "--num-items", "1"]) == 2
        assert "vllm" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# mugrpo report on two runs: the summary's numbers are those of the runs' metrics.jsonl.


def _md_table(text: str, heading: str) -> list[dict]:
    block = text.split(f"## {heading}")[1].split("\n## ")[0]
    lines = [ln for ln in block.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def test_report_numbers_equal_the_metrics(runs, tmp_path):
    out = tmp_path / "report"
    level = 0.02
    assert main(["report", str(runs["mu"]), str(runs["grpo"]), "--out", str(out), "--labels", "mu,grpo",
                 "--levels", str(level)]) == 0
    for name in ("reward.png", "eval.png", "drift_mu.png", "drift_grpo.png", "stage_time.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 200_000, name
    md = (out / "summary.md").read_text()
    rows = {r["run"]: r for r in _md_table(md, "Runs")}
    phases = {r["run"]: r for r in _md_table(md, "Time per phase")}
    reach = _md_table(md, "Training clock to first reach reward/mean")[0]
    for label in ("mu", "grpo"):
        records = read_metrics(runs[label] / "metrics.jsonl")
        stages = [r for r in records if r["kind"] == "stage"]
        evals = [r for r in records if r["kind"] == "eval"]
        updates = [r for r in records if r["kind"] == "update"]
        row = rows[label]
        assert row["stages"] == str(len(stages)) and row["updates"] == str(updates[-1]["update"])
        assert row["mu"] == str(stages[0]["update_in_stage"])
        assert row["reward first"] == f"{stages[0]['reward/mean']:.3f}"
        assert row["reward last"] == f"{stages[-1]['reward/mean']:.3f}"
        assert row["reward best"] == f"{max(s['reward/mean'] for s in stages):.3f}"
        assert row["eval/greedy_acc last"] == f"{evals[-1]['eval/greedy_acc']:.3f}"
        wall = max(r["time_s"] for r in records)
        eval_s = sum(e["perf/eval_s"] for e in evals)
        assert row["wall-clock s"] == f"{wall:.1f}" and row["eval s"] == f"{eval_s:.1f}"
        assert row["training clock s"] == f"{wall - eval_s:.1f}"
        for phase in ("generate", "optimize", "eval"):
            assert phases[label][phase] == f"{sum(s[f'perf/{phase}_s'] for s in stages):.1f}"
        # Time to reach the level: the stage whose rollouts first score >= level, placed when its
        # first update began, minus the evaluation seconds spent before that moment.
        hit = next((s for s in stages if s["reward/mean"] >= level), None)
        cell = reach[f"{label} s (update)"]
        if hit is None:
            assert cell == "not reached"
            continue
        first = next(u for u in updates if u["stage"] == hit["stage"])
        t_ready = first["time_s"] - first["perf/update_s"]
        clock = t_ready - sum(e["perf/eval_s"] for e in evals if e["time_s"] <= t_ready)
        assert cell == f"{clock:.1f} ({hit['update'] - hit['update_in_stage']})"
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary["runs"]] == ["mu", "grpo"]
    assert math.isclose(summary["runs"][0]["reward_last"], _kind(runs["mu"], "stage")[-1]["reward/mean"])
    assert re.search(r"speed-up grpo vs mu", md)
