"""The environment examples run end to end on the tiny model (examples/env_*.py).

The random tiny model never answers right and rarely ends a turn, so what is checked is what the
examples wire, not learning: each stage is multi-turn through the right environment (its counts
are logged, every trajectory ended in one of the loop's ways) and the run exports its model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
ENDS = ("done", "turn_limit", "length", "overflow", "env_error", "env_timeout", "env_bad_output")


def run_example(name: str, tmp_path: Path, model_dir: str, *extra: str) -> list[dict]:
    # 96 tokens per trajectory: the random tiny model ends about 60 % of its turns with EOS within
    # them (EOS is ~1 % per token), so environment turns do get appended.
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--model", model_dir, "--updates", "2",
                        "--run-dir", str(run_dir), "--max-new-tokens", "96", "--rows", "48", *extra],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "final_model" / "config.json").is_file()
    stages = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stages = [s for s in stages if s.get("kind") == "stage"]
    assert len(stages) == 2 and r.stdout.count("stage ") >= 2
    for s in stages:
        assert sum(s[f"env/num_{end}"] for end in ENDS) == s["stage/num_sequences"]  # every trajectory ended once
    return stages


def test_calculator_example(tmp_path):
    from mugrpo.models.tiny import build_tiny_model

    # The tool instructions are about 900 characters, one token each for the tiny model: a longer context.
    model_dir = str(build_tiny_model(tmp_path / "model", max_positions=2048))
    stages = run_example("env_calculator.py", tmp_path, model_dir, "--max-prompt-tokens", "1536")
    assert all("env/tool_calls" in s and "env/tool_errors" in s for s in stages)  # the tool counts are logged
    assert sum(s["env/num_done"] for s in stages) > 0  # turns without a call ended trajectories as answers


@pytest.mark.slow  # ~19 s
def test_multi_attempt_example(tmp_path, tiny_model_dir):
    stages = run_example("env_multi_attempt.py", tmp_path, tiny_model_dir, "--attempts", "2")
    for s in stages:
        # The tiny model solves nothing, so a trajectory the environment ended ("done") made both
        # attempts; one cut by the token budget made fewer. At most 2 attempts each.
        assert s["env/num_solved"] == 0
        assert 2 * s["env/num_done"] <= s["env/num_attempts"] <= 2 * s["stage/num_sequences"]
    assert sum(s["env/num_env_tokens"] for s in stages) > 0  # "Incorrect, try again." was appended


@pytest.mark.slow  # ~27 s
def test_third_party_example(tmp_path, tiny_model_dir):
    stages = run_example("env_third_party.py", tmp_path, tiny_model_dir, "--max-turns", "2")
    assert all("env/steps" in s for s in stages)  # skyrl-gym's own get_metrics() came through
    assert sum(s["env/num_env_tokens"] for s in stages) > 0  # its re-prompt was appended
