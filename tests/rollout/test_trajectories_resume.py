"""Training with independent trajectories (the HF engine offered to concurrent callers, one call at a time,
as an HF service answers: tests/multiturn_fakes.py ConcurrentHF) in deterministic mode: two runs are equal and
a run killed mid-trajectory resumes bitwise, although random step latencies reorder the trajectories; the
stage records say the trajectories were independent (steps overlapped generation)."""
import subprocess
import sys

import pytest
from kit.test_resume import _cmd, _env, _final_params
from multiturn_fakes import LAUNCH
from safetensors.torch import load_file

from mugrpo.observability.loggers import read_metrics
from mugrpo.stages.data import StageData

ENV = ["task.env=multiturn_envs:SlowTryAgain", "rollout.max_new_tokens=32", "env.max_tokens_per_turn=6",
       "rollout.engine=hf-concurrent", "rollout.group_size=4", "schedule.prompts_per_update=2", "eval.num_items=0"]


def _train(run_dir, model_dir, die_at=None):
    cmd = _cmd(run_dir, model_dir, *ENV)
    assert cmd[1:3] == ["-m", "mugrpo"]
    return subprocess.run([sys.executable, "-c", LAUNCH, *cmd[3:]], env=_env(die_at), capture_output=True, text=True)


def _stages(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "stage"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("independent") / "run"
    r = _train(run_dir, tiny_model_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "multi-turn trajectories" in r.stdout + r.stderr and "independent" in r.stdout + r.stderr  # the plan
    return run_dir


@pytest.mark.slow  # two short training runs and a resume (~1 min on 2 cores)
def test_independent_trajectories_train_reproducibly_and_resume_bitwise(tmp_path, tiny_model_dir, reference):
    again = tmp_path / "again"
    assert _train(again, tiny_model_dir).returncode == 0
    for stage in (0, 1):  # two runs: the same stage data, shard for shard
        name = f"stages/stage_{stage:03d}/rollouts_rank0.safetensors"
        a, b = load_file(str(reference / name)), load_file(str(again / name))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), name
    assert sum(r["perf/num_overlapped_steps"] for r in _stages(reference)) >= 1  # steps ran beside generation
    assert any(r["env/turns_mean"] > 1 for r in _stages(reference))  # some really are multi-turn
    # Killed in stage 1's generation, mid-trajectory, after its 3rd answered request (kill point "turn"; no
    # evaluation: stage generation alone answers requests), then resumed from stage 0's checkpoint.
    stage_0 = StageData.load(reference / "stages" / "stage_000" / "rollouts_rank0.safetensors")
    # requests of stage 0: one per group (turn 0), then one per later turn of each trajectory
    requests = len(stage_0.prompts) + sum(max(stage_0.turns_of(s)) for s in range(len(stage_0.responses)))
    run_dir = tmp_path / "run"
    killed = _train(run_dir, tiny_model_dir, die_at=f"turn:{requests + 3}")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run_dir / "stages" / "stage_000" / "shards.json").exists()
    assert not (run_dir / "stages" / "stage_001" / "shards.json").exists()
    resumed = subprocess.run([sys.executable, "-c", LAUNCH, "train", "--resume", str(run_dir)], env=_env(),
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = _final_params(reference), _final_params(run_dir)
    assert ref.keys() == got.keys() and all(ref[k].equal(got[k]) for k in ref)
    assert [r["env/num_done"] for r in _stages(run_dir)] == [r["env/num_done"] for r in _stages(reference)]
