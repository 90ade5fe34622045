"""The report's summary of a run with stages generated ahead (mugrpo/observability/report_data.py
``async_summary``, rendered by ``mugrpo report``)."""
import json

import pytest

from mugrpo.observability import report_data as rd
from mugrpo.observability.report import write_report

pytestmark = pytest.mark.unit


def _stage(s, lag_max, lag_mean, wall, wait, idle, n=16):
    return {"kind": "stage", "stage": s, "update": 2 * (s + 1), "update_in_stage": 2, "time_s": 10.0 * (s + 1),
            "reward/mean": 0.1, "stage/num_sequences": n, "stage/policy_lag_max": lag_max,
            "stage/policy_lag_mean": lag_mean, "perf/stage_wall_s": wall, "perf/trainer_wait_s": wait,
            "perf/engine_idle_s": idle, "perf/trainer_idle_frac": wait / wall, "perf/engine_idle_frac": idle / wall}


def _run_dir(tmp_path, name, records, async_stages=1):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.yaml").write_text(f"preset: mu-grpo\nschedule: {{async_stages: {async_stages}}}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.mark.unit
def test_async_summary_sums_waits_over_intervals_and_weights_the_lag_by_sequences(tmp_path):
    # stage 0: 16 sequences at lag 0, 8 s of which the trainer waited 6 and the engine idled 1;
    # stage 1: 48 sequences, lag 1 (a third at lag 0 after a resume: mean 2/3), 12 s, waits 0, idle 3.
    run = rd.load_run(_run_dir(tmp_path, "a", [_stage(0, 0, 0.0, 8.0, 6.0, 1.0),
                                               _stage(1, 1, 2 / 3, 12.0, 0.0, 3.0, n=48)]))
    a = rd.async_summary(run)
    # trainer: (6 + 0) / (8 + 12) = 0.3; engine: (1 + 3) / 20 = 0.2; lag mean (16 x 0 + 48 x 2/3) / 64 = 0.5
    assert (a["async_stages"], a["num_stages"], a["wall_s"], a["policy_lag_max"]) == (1, 2, 20.0, 1)
    assert a["trainer_idle_frac"] == pytest.approx(0.3) and a["engine_idle_frac"] == pytest.approx(0.2)
    assert a["policy_lag_mean"] == pytest.approx(0.5)
    assert [s["trainer_idle_frac"] for s in a["by_stage"]] == [0.75, 0.0]  # 6 / 8, 0 / 12


@pytest.mark.unit
def test_a_synchronous_run_has_no_async_summary_and_no_section(tmp_path):
    record = {"kind": "stage", "stage": 0, "update": 2, "update_in_stage": 2, "time_s": 5.0, "reward/mean": 0.1}
    run = rd.load_run(_run_dir(tmp_path, "sync", [record], async_stages=0))
    assert rd.async_summary(run) is None
    ahead = rd.load_run(_run_dir(tmp_path, "ahead", [_stage(0, 0, 0.0, 8.0, 6.0, 1.0)]))
    out = tmp_path / "report"
    write_report([run, ahead], out)
    section = (out / "summary.md").read_text().split("## Stages generated ahead\n")[1].split("\n## ")[0]
    # only the run with stages generated ahead: waits 6 / 8 = 0.750, idle 1 / 8 = 0.125
    assert [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:] == [
        "| ahead | 1 | 0 | 0.00 | 0.750 | 0.125 | 8.0 |"]
