"""`mugrpo report` shows environment metrics per stage, not only their sums over the
run, so a change across stages is visible. Records written by hand (tests/observability/test_report_env.py's run)."""
import json
import math

from observability.test_report_env import _run

from mugrpo.observability import report_data as rd
from mugrpo.observability.report import write_report


def test_environment_numbers_per_stage_by_hand(tmp_path):
    first, second = rd.environment_summary(_run(tmp_path))["by_stage"]
    # stage 0: 6 done + 1 turn limit + 1 overflow = 8 trajectories; 20 env tokens of 60 + 20; 5 tool calls
    assert (first["stage"], first["num_trajectories"], first["turns_mean"]) == (0, 8, 2.0)
    assert first["end_frac"]["done"] == 6 / 8 and first["end_frac"]["turn_limit"] == 1 / 8
    assert first["env_token_frac"] == 20 / 80 and first["tools"] == {"env/tool_calls": 5}
    # stage 1: 7 done + 1 overflow; 80 env tokens of 40 + 80; 7 tool calls
    assert (second["stage"], second["num_trajectories"], second["turns_mean"]) == (1, 8, 1.5)
    assert second["end_frac"]["done"] == 7 / 8 and second["end_frac"]["turn_limit"] == 0
    assert math.isclose(second["env_token_frac"], 80 / 120) and second["tools"] == {"env/tool_calls": 7}
    assert first["reward_mean"] == second["reward_mean"] == 0.5


def test_the_report_has_a_row_per_stage(tmp_path):
    write_report([_run(tmp_path)], tmp_path / "out")
    md = (tmp_path / "out" / "summary.md").read_text()
    section = md.split("### Environments by stage", 1)[1].split("\n## ", 1)[0]
    assert "| stage | trajectories | turns mean | env token frac | env reward mean | done frac | turn_limit frac | " \
           "overflow frac | env/tool_calls |" in section
    assert "| 0 | 8 | 2.00 | 0.250 | 0.5 | 0.750 | 0.125 | 0.125 | 5 |" in section
    assert "| 1 | 8 | 1.50 | 0.667 | 0.5 | 0.875 | 0.000 | 0.125 | 7 |" in section
    by_stage = json.loads((tmp_path / "out" / "summary.json").read_text())["environments"]["mt"]["by_stage"]
    assert [s["num_trajectories"] for s in by_stage] == [8, 8]
