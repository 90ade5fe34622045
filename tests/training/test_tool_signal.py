"""Will RL get a signal? The starting policy's informative groups and tool-call rate, printed at stage 0
and logged per stage; per-tool counts in the stage records."""
from conftest import TINY_OVERRIDES

from mugrpo.config import load_config
from mugrpo.observability.loggers import read_metrics
from mugrpo.stages.generation import start_signal
from mugrpo.pipeline import train


def test_the_start_signal_line_by_hand():
    # 3 of 4 groups have equal rewards -> 25% informative; no trajectory called a tool -> the advice.
    line = start_signal({"stage/zero_var_group_frac": 0.75}, {"env/tool_call_frac": 0.0}, {})
    assert "25% of its groups are informative" in line and "0% of its trajectories called a tool" in line
    assert "warm-start the model" in line
    # dynamic sampling: the fraction over every generated group, not the kept ones (all informative)
    line = start_signal({"stage/zero_var_group_frac": 0.0}, {"env/tool_call_frac": 0.5},
                        {"stage/informative_frac": 0.125})
    assert "12% of its groups" in line and "50% of its trajectories" in line and "warm-start" not in line
    assert "tool" not in start_signal({"stage/zero_var_group_frac": 0.5}, {}, {})  # single-turn: no tool words


def test_a_tool_run_reports_tool_use_per_stage_and_says_when_there_is_none(tmp_path, tiny_model_dir, capsys):
    # The random tiny model never writes a <tool_call>: every stage says 0 and stage 0 says what to do.
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES, "task.env=calculator",
                                            "env.max_turns=2", "rollout.max_new_tokens=16",
                                            "task.max_prompt_tokens=1000", "schedule.total_updates=2",
                                            "schedule.num_stages=2", "eval.num_items=0"])
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    assert out.count("stage 0, the starting policy:") == 1 and "no trajectory called a tool" in out.lower()
    stages = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "stage"]
    assert len(stages) == 2
    for record in stages:
        assert record["env/tool_call_frac"] == 0.0 and record["env/tool_calls/calculate"] == 0.0
        assert record["env/num_with_tool_call"] == 0.0 and record["env/tool_calls"] == 0.0
