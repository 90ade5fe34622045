"""`mugrpo report` on a multi-turn run: the environment section from hand-written records."""
import json
import math

from mugrpo.observability import report_data as rd
from mugrpo.observability.report import write_report

ENDS = {"env/num_done": 0, "env/num_turn_limit": 0, "env/num_length": 0, "env/num_overflow": 0,
        "env/num_env_error": 0, "env/num_env_timeout": 0, "env/num_env_bad_output": 0}


def _stage(stage, done, turn_limit, overflow, turns_mean, policy, env, tool_calls):
    return {"kind": "stage", "stage": stage, "update": 2 * stage + 2, "update_in_stage": 2,
            "time_s": 10.0 * (stage + 1),
            "reward/mean": 0.1, **ENDS, "env/num_done": done, "env/num_turn_limit": turn_limit,
            "env/num_overflow": overflow, "env/turns_mean": turns_mean, "env/reward_mean": 0.5,
            "env/num_policy_tokens": policy, "env/num_env_tokens": env, "env/tool_calls": tool_calls}


def _update(u, stage, frac0, frac1, first):
    return {"kind": "update", "stage": stage, "update": u, "update_in_stage": (u - 1) % 2, "time_s": 10.0 * stage + u,
            "perf/update_s": 0.5, "loss/veto_token_frac_turn0": frac0, "loss/veto_token_frac_turn1": frac1,
            "loss/first_trigger_turn": first}


def _run(tmp_path):
    folder = tmp_path / "mt"
    folder.mkdir()
    records = [_update(1, 0, 0.0, 0.1, 1.0), _update(2, 0, 0.0, 0.3, None),
               _stage(0, 6, 1, 1, 2.0, 60, 20, 5),       # 8 trajectories, 16 turns
               _update(3, 1, 0.2, None, 0.0), _update(4, 1, 0.0, 0.2, 0.5),
               _stage(1, 7, 0, 1, 1.5, 40, 80, 7)]       # 8 trajectories, 12 turns
    (folder / "config.yaml").write_text("preset: mu-grpo\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return rd.load_run(folder)


def test_environment_summary_by_hand(tmp_path):
    e = rd.environment_summary(_run(tmp_path))
    assert e["num_trajectories"] == 16  # 8 + 8
    assert e["end_frac"]["done"] == 13 / 16 and e["end_frac"]["turn_limit"] == 1 / 16
    assert e["end_frac"]["overflow"] == 2 / 16
    assert e["turns_mean"] == (16 + 12) / 16  # 2.0 x 8 + 1.5 x 8 turns over 16 trajectories
    assert e["env_token_frac"] == 100 / 200  # (20 + 80) env tokens of (60 + 20 + 40 + 80)
    assert e["counts"]["env/tool_calls"] == 12
    # Per-turn means over updates, nulls left out: turn 0 (0 + 0 + 0.2 + 0) / 4; turn 1 (0.1 + 0.3 + 0.2) / 3;
    # first trigger turn (1 + 0 + 0.5) / 3.
    by_turn = e["veto_by_turn"]
    assert math.isclose(by_turn["loss/veto_token_frac_turn0"], 0.05)
    assert math.isclose(by_turn["loss/veto_token_frac_turn1"], 0.2)
    assert math.isclose(by_turn["loss/first_trigger_turn"], 0.5)


def test_the_report_has_an_environment_section_only_for_multi_turn_runs(tmp_path):
    run = _run(tmp_path)
    write_report([run], tmp_path / "out")
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "## Environments" in md and "env/tool_calls" in md and "loss/veto_token_frac_turn1" in md
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["environments"]["mt"]["num_trajectories"] == 16
    single = tmp_path / "single"
    single.mkdir()
    (single / "metrics.jsonl").write_text(json.dumps({"kind": "stage", "stage": 0, "update": 2, "update_in_stage": 2,
                                                      "time_s": 1.0, "reward/mean": 0.1}) + "\n")
    assert rd.environment_summary(rd.load_run(single)) is None
