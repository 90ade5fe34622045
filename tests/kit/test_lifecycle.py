"""A run's lifecycle (mugrpo.kit.lifecycle, mugrpo.stopping, mugrpo.run_dir.resume_command): every kind of
run records its kind and is told the command that resumes it; a resume of another kind is refused before
anything is written; a stop in any phase, from the CLI's first second, ends in a message and a resumable
run directory; the one loop around the step checkpoints by the global step, at each unit's end and on a stop."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.config import load_config
from mugrpo.kit.checkpoint import RunState
from mugrpo.kit.distributed import World
from mugrpo.kit.lifecycle import RunLifecycle
from mugrpo.run_dir import RunDir, resume_command
from mugrpo.stopping import Interrupted

DEMOS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "11111"}]}
         for i in range(4)]
SFT_KEYS = ["train.autocast=none", "train.progress=false", "train.deterministic=true", "warmstart.batch_size=2",
            "warmstart.steps=2"]
RL_KEYS = [*TINY_OVERRIDES, "train.deterministic=true", "schedule.total_updates=2", "schedule.num_stages=1",
           "eval.num_items=0", "rollout.engine=hf"]


def _mugrpo(*args, stop_at=None):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MUGRPO_DIE_AT", None)
    env.pop("MUGRPO_STOP_AT", None)
    if stop_at:
        env["MUGRPO_STOP_AT"] = stop_at
    return subprocess.run([sys.executable, "-m", "mugrpo", *map(str, args)], env=env, capture_output=True, text=True)


def _snapshot(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    path = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in DEMOS))
    return path


@pytest.mark.unit
@pytest.mark.parametrize("kind,expected", [("sft", "mugrpo sft --resume {run}"), ("rl", "mugrpo train --resume {run}"),
                                           ("replay", "mugrpo train --resume {run}"),
                                           ("warmstart", "mugrpo train --resume {parent}")])
def test_the_resume_command_follows_the_recorded_kind(tmp_path, kind, expected):
    run = tmp_path / "run" / "warmstart" if kind == "warmstart" else tmp_path / "run"
    RunDir(run).write_kind(kind)
    assert resume_command(run) == expected.format(run=run, parent=run.parent)


@pytest.mark.unit
def test_a_warm_start_folder_without_a_record_is_known_by_its_place(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "warmstart").mkdir()
    assert RunDir(tmp_path / "warmstart").kind() == "warmstart"
    assert RunDir(tmp_path).kind() is None  # a run from before kinds were recorded: no claim made for it


@pytest.mark.slow  # ~19 s
def test_train_resume_of_an_sft_run_exits_2_naming_sft_and_writes_nothing(tiny_model_dir, demos, tmp_path):
    run = tmp_path / "sft"
    r = _mugrpo("sft", "--run-dir", run, f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *SFT_KEYS)
    assert r.returncode == 0, r.stderr[-2000:]
    assert RunDir(run).kind() == "sft"
    before = _snapshot(run)
    r = _mugrpo("train", "--resume", run)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"mugrpo sft --resume {run}" in r.stderr and "nothing was written" in r.stderr
    assert _snapshot(run) == before


def test_a_stop_before_any_heavy_import_exits_130_and_writes_nothing(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    r = _mugrpo("train", "--run-dir", run, f"model.name={tiny_model_dir}", *RL_KEYS, stop_at="start")
    assert r.returncode == 130, r.stderr[-2000:]
    assert "stopped before the run wrote anything" in r.stderr
    assert not run.exists()


@pytest.mark.slow  # ~41 s
def test_a_stop_while_a_new_run_loads_writes_nothing_and_the_same_command_trains_as_uninterrupted(
        tiny_model_dir, tmp_path):
    whole = tmp_path / "whole"
    assert _mugrpo("train", "--run-dir", whole, f"model.name={tiny_model_dir}", *RL_KEYS).returncode == 0
    run = tmp_path / "run"
    args = ("train", "--run-dir", run, f"model.name={tiny_model_dir}", *RL_KEYS)
    r = _mugrpo(*args, stop_at="model_loaded")
    assert r.returncode == 130, r.stderr[-2000:]
    assert "stopped before the run wrote anything" in r.stderr and not run.exists()
    r = _mugrpo(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    a = load_file(whole / "final_model" / "model.safetensors")
    b = load_file(run / "final_model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.slow  # ~20 s; the new-run case is kept
def test_a_stop_while_a_resumed_run_loads_names_its_resume_command(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    r = _mugrpo("train", "--run-dir", run, f"model.name={tiny_model_dir}", *RL_KEYS, stop_at="update:1")
    assert r.returncode == 130, r.stderr[-2000:]
    r = _mugrpo("train", "--resume", run, stop_at="model_loaded")
    assert r.returncode == 130, r.stderr[-2000:]
    assert f"Resume with: mugrpo train --resume {run}" in r.stderr
    assert _mugrpo("train", "--resume", run).returncode == 0


@pytest.mark.slow  # ~24 s; tests/warmstart/test_phase_stops_and_guard.py keeps a SIGTERM in the warm start
def test_a_stop_between_the_warm_start_and_rl_names_the_run_and_resumes_into_rl(tiny_model_dir, demos, tmp_path):
    run = tmp_path / "run"
    args = ("train", "--run-dir", run, f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *RL_KEYS,
            "warmstart.batch_size=2", "warmstart.steps=2")
    r = _mugrpo(*args, stop_at="phase_end")
    assert r.returncode == 130, r.stderr[-2000:]
    assert f"Resume with: mugrpo train --resume {run}" in r.stderr
    assert (run / "warmstart" / "final_model" / "config.json").is_file()  # the warm start is done and kept
    assert RunDir(run).kind() == "rl" and RunDir(run / "warmstart").kind() == "warmstart"
    r = _mugrpo("train", "--resume", run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warm start done earlier" in r.stdout
    assert (run / "final_model" / "model.safetensors").is_file()


@pytest.mark.slow  # ~11 s
def test_a_stop_inside_the_warm_start_of_a_train_run_names_the_train_run(tiny_model_dir, demos, tmp_path):
    run = tmp_path / "run"
    r = _mugrpo("train", "--run-dir", run, f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *RL_KEYS,
                "warmstart.batch_size=2", "warmstart.steps=3", stop_at="sft_step:1")
    assert r.returncode == 130, r.stderr[-2000:]
    assert f"Resume with: mugrpo train --resume {run}" in r.stderr  # not the sub-run's folder
    assert f"--resume {run / 'warmstart'}" not in r.stderr


class _CountingPhase:
    """A phase of ``total`` steps in units of ``unit`` steps (the last unit may be shorter), on a one-layer
    model: what the loop around the step needs, and a record of what it was asked to do."""

    def __init__(self, total, unit, every, stop_after=None, stopper=None):
        self.state, self.t_start, self.total_steps, self.checkpoint_every = RunState(), 0.0, total, every
        self.unit, self.stop_after, self.stopper, self.ended = unit, stop_after, stopper, []
        self.policy = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def checkpointed(self):
        return self.policy, self.optimizer, self.scheduler

    def step(self):
        self.state.update += 1
        if self.state.update == self.stop_after:
            self.stopper.requested = True
        return self.state.update % self.unit == 0 or self.state.update == self.total_steps

    def end_unit(self):
        self.ended.append(self.state.update)

    def more(self):
        return self.state.update < self.total_steps


def _saved_updates(run):
    return [int(p.name.split("_")[1]) for p in sorted((run / "checkpoints").glob("ckpt_*"))]


@pytest.mark.unit
def test_the_loop_checkpoints_every_n_global_steps_and_at_each_units_end(tmp_path):
    # Units of 3 steps, 7 in all, every=2: the cadence counts global steps (2, 4, 6), not steps within a
    # unit (which would give 2 and 5); units end at 3, 6 and 7, each checkpointed once.
    cfg = load_config(overrides=["checkpoint.keep_last=10"])
    with RunLifecycle(RunDir(tmp_path / "run"), cfg, "sft", False, World()) as life, life.phase() as run:
        phase = _CountingPhase(total=7, unit=3, every=2)
        run.steps(phase)
    assert phase.ended == [3, 6, 7]
    assert _saved_updates(tmp_path / "run") == [2, 3, 4, 6, 7]


@pytest.mark.unit
def test_a_stop_mid_unit_checkpoints_that_step_and_ends_the_run(tmp_path):
    cfg = load_config(overrides=["checkpoint.keep_last=10"])
    with pytest.raises(Interrupted):
        with RunLifecycle(RunDir(tmp_path / "run"), cfg, "sft", False, World()) as life, life.phase() as run:
            phase = _CountingPhase(total=7, unit=3, every=0, stop_after=5, stopper=life.stopper)
            run.steps(phase)
    assert phase.ended == [3] and phase.state.update == 5
    assert _saved_updates(tmp_path / "run") == [3, 5]  # the unit's end, then the stop's step
