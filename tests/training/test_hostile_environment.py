"""A run through a hostile environment (tests/guard_envs.py: a constructor that raises on some
instances, steps that raise, a close that always raises, NaN metadata) trains to the end: each
failure counted in the stage's metrics and its first traceback printed once per stage."""
from conftest import TINY_OVERRIDES

from mugrpo.config import load_config
from mugrpo.observability.loggers import read_metrics
from mugrpo.pipeline import train


def test_a_run_through_a_hostile_environment_trains_counted_and_reported(tmp_path, tiny_model_dir, capsys):
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES,
                                            "task.env=guard_envs:Flaky", "rollout.max_new_tokens=16",
                                            "env.max_turns=3", "eval.num_items=0", "schedule.total_updates=4",
                                            "env.step_isolation=thread"])  # its tracebacks as this process prints them
    train(cfg, tmp_path / "run")
    stages = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "stage"]
    assert len(stages) >= 2 and (tmp_path / "run" / "final_model").is_dir()
    assert sum(s["env/num_items_skipped"] for s in stages) > 0
    assert all(s["stage/num_prompts_skipped"] >= s["env/num_items_skipped"] for s in stages)
    assert sum(s["env/num_env_error"] for s in stages) > 0
    assert all(s["env/num_close_errors"] == s["stage/num_sequences"] for s in stages)
    assert all("env/odd" not in s for s in stages) and sum(s.get("env/num_dropped_values", 0) for s in stages) > 0
    out = capsys.readouterr().out
    for kind in ("start error", "env error", "close error", "dropped value"):
        assert out.count(f"stage 0: environment {kind}") == 1, kind
    assert "RuntimeError: constructor broke" in out and "OSError: close broke" in out and "Traceback" in out
