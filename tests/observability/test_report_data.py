"""Report numbers from a hand-written metrics.jsonl: clocks, reward placement, time-to-level, phases."""

import json

import pytest

from mugrpo.observability import report_data as rd
from mugrpo.cli import main
from mugrpo.observability.report import write_report


def _records(scale: float = 1.0):
    """Two stages of mu = 2 with evaluations at updates 0, 2, 4. Times are multiplied by ``scale``."""
    t = lambda x: x * scale  # noqa: E731
    perf0 = {"perf/sync_s": t(0.5), "perf/generate_s": t(2.0), "perf/score_s": t(0.5), "perf/optimize_s": t(2.0),
             "perf/eval_s": t(5.0)}                                   # sums to 10 = stage 0's wall-clock
    perf1 = {"perf/sync_s": t(0.5), "perf/generate_s": t(2.5), "perf/score_s": t(0.5), "perf/optimize_s": t(2.0),
             "perf/eval_s": t(2.0)}                                   # sums to 7.5 of 8 s: 0.5 s "other"
    upd = lambda u, s, i, time, loss: {"kind": "update", "stage": s, "update": u, "update_in_stage": i,  # noqa: E731
                                       "time_s": t(time), "perf/update_s": t(1.0), "loss/policy": loss,
                                       "loss/ratio_mean_neg": 1.0 - 0.1 * i}
    ev = lambda u, s, time, secs, acc: {"kind": "eval", "stage": s, "update": u, "update_in_stage": u % 2,  # noqa: E731
                                        "time_s": t(time), "perf/eval_s": t(secs), "eval/greedy_acc": acc}
    return [
        ev(0, 0, 2.0, 2.0, 0.1),
        upd(1, 0, 0, 6.0, -0.1), upd(2, 0, 1, 7.0, -0.2),
        ev(2, 0, 10.0, 3.0, 0.4),
        {"kind": "stage", "stage": 0, "update": 2, "update_in_stage": 2, "time_s": t(10.0), "reward/mean": 0.2, **perf0},
        upd(3, 1, 0, 15.0, -0.3), upd(4, 1, 1, 16.0, -0.4),
        upd(4, 1, 1, 16.5, -0.45),                                    # re-logged after a resume: this one wins
        ev(4, 1, 18.0, 2.0, 0.6),
        {"kind": "stage", "stage": 1, "update": 4, "update_in_stage": 2, "time_s": t(18.0), "reward/mean": 0.5, **perf1},
    ]


def _run_dir(tmp_path, name, records):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.yaml").write_text("preset: mu-grpo\nschedule: {updates_per_stage: 2}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"torn": ')
    return folder


def test_series_clock_and_levels_by_hand(tmp_path):
    run = rd.load_run(_run_dir(tmp_path, "a", _records()))
    assert [u["loss/policy"] for u in run.updates] == [-0.1, -0.2, -0.3, -0.45]  # deduped, torn line skipped
    reward = rd.reward_series(run)
    # stage 0: first update began at 6 - 1 = 5 s, after 2 s of eval -> clock 3; policy after 0 updates
    # stage 1: first update began at 15 - 1 = 14 s, after 2 + 3 = 5 s of eval -> clock 9; after 2 updates
    assert (reward.updates, reward.clock_s, reward.values) == ([0.0, 2.0], [3.0, 9.0], [0.2, 0.5])
    ev = rd.eval_series(run, "eval/greedy_acc")
    # each eval's clock excludes itself: 2 - 2 = 0, 10 - (2 + 3) = 5, 18 - (2 + 3 + 2) = 11
    assert (ev.updates, ev.clock_s, ev.values) == ([0.0, 2.0, 4.0], [0.0, 5.0, 11.0], [0.1, 0.4, 0.6])
    assert rd.first_reach(reward, 0.3) == (9.0, 2.0)
    assert rd.first_reach(reward, 0.2) == (3.0, 0.0)
    assert rd.first_reach(reward, 0.6) is None
    times = rd.stage_times(run)
    assert times[0]["other"] == pytest.approx(0.0) and times[0]["total"] == 10.0
    assert times[1]["other"] == pytest.approx(0.5) and times[1]["total"] == 8.0  # 18 - 10
    assert times[1]["checkpoint"] == 0.0  # not logged: counts as 0, the time shows up in "other"
    s = rd.summary(run, "eval/greedy_acc")
    assert (s["wall_clock_s"], s["eval_s"], s["train_clock_s"]) == (18.0, 7.0, 11.0)
    assert (s["reward_first"], s["reward_last"], s["eval_best"], s["updates_per_stage"]) == (0.2, 0.5, 0.6, 2)
    assert rd.drift_by_stage(run, "loss/ratio_mean_neg") == {0: ([0, 1], [1.0, 0.9]), 1: ([0, 1], [1.0, 0.9])}


def test_default_levels_are_reached_by_every_run():
    a = rd.Series([0, 2], [3, 9], [0.2, 0.5])
    b = rd.Series([0, 4], [3, 9], [0.1, 0.3])
    # from the highest start (0.2) to the lowest best (0.3) in quarters
    assert rd.default_levels([a, b]) == pytest.approx([0.225, 0.25, 0.275, 0.3])
    assert all(rd.first_reach(s, lvl) for s in (a, b) for lvl in rd.default_levels([a, b]))


def test_speedup_table_from_a_run_twice_as_slow(tmp_path):
    fast = rd.load_run(_run_dir(tmp_path, "fast", _records()))
    slow = rd.load_run(_run_dir(tmp_path, "slow", _records(scale=2.0)))
    write_report([fast, slow], tmp_path / "out", levels=[0.3], eval_levels=[0.4])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    row = summary["reward_levels"][0]
    assert row["clock_s"] == {"fast": 9.0, "slow": 18.0} and row["update"] == {"fast": 2.0, "slow": 2.0}
    assert row["speedup_vs_first"] == {"slow": 0.5}  # fast's 9 s / slow's 18 s
    assert summary["eval_levels"][0]["clock_s"] == {"fast": 5.0, "slow": 10.0}
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "| 0.3 | 9.0 (2) | 18.0 (2) | 0.50x |" in md


def test_report_cli_rejects_a_folder_without_metrics(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_diagnostics_against_the_position_in_the_stage_by_hand(tmp_path):
    run = rd.load_run(_run_dir(tmp_path, "a", _records()))
    rows = rd.by_position(run, "eval/greedy_acc")
    assert [(r["first"], r["num_updates"], r["num_evals"]) for r in rows] == [(0, 2, 3), (1, 2, 0)]
    # Position 0: updates 1 and 3, E[rho|A<0] = 1 - 0.1 x 0 = 1.0; position 1: updates 2 and 4 (the
    # re-logged 4 counted once) = 0.9. Evaluations (update_in_stage 0 here): (0.1 + 0.4 + 0.6) / 3.
    assert rows[0]["loss/ratio_mean_neg"] == pytest.approx(1.0) and rows[1]["loss/ratio_mean_neg"] == pytest.approx(0.9)
    assert rows[0]["eval/greedy_acc"] == pytest.approx(1.1 / 3)
    assert rows[1]["eval/greedy_acc"] != rows[1]["eval/greedy_acc"]  # NaN: nothing evaluated there
    assert rows[0]["loss/kl_behavior"] != rows[0]["loss/kl_behavior"]  # NaN: not logged in these records
    # Binned: at most one row here, positions 0-1 together, means over all four updates.
    (both,) = rd.by_position(run, None, max_rows=1)
    assert (both["first"], both["last"], both["num_updates"]) == (0, 1, 4)
    assert both["loss/ratio_mean_neg"] == pytest.approx(0.95) and "eval/greedy_acc" not in both
    out = tmp_path / "report"
    write_report([run], out)
    assert "Drift against the position in the stage" in (out / "summary.md").read_text()
