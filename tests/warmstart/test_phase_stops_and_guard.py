"""The warm start of an RL run and a stop: a SIGTERM anywhere in ``mugrpo train
warmstart.data=...`` is the RL run's stop. It ends the run with the resume command before RL builds,
instead of being dropped when the warm start's own handler was restored (the run then trained to its
end); a warm start that diverges stops with exit 2 and writes no model; without bars the warm start
prints a line per step. Real subprocess runs of the tiny model."""
import signal
import subprocess
import sys

import pytest
from warmstart.test_phase import DEMO_ROWS, _env, _train_cmd, _write


def _mugrpo(*args, stop_at=None):
    env = _env()
    if stop_at:
        env["MUGRPO_STOP_AT"] = stop_at
    return subprocess.run([sys.executable, "-m", "mugrpo", *map(str, args)], env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("demos") / "demos.jsonl", DEMO_ROWS)


@pytest.mark.slow  # ~23 s; tests/kit/test_lifecycle.py keeps a stop between the warm start and RL
def test_a_stop_in_the_warm_starts_last_step_stops_the_run_before_rl(tmp_path, tiny_model_dir, demos):
    run_dir = tmp_path / "run"
    # step 12 of 12 (6 demonstrations, batch 2, 4 epochs): the step after which the warm start exports
    stopped = _mugrpo(*_train_cmd(run_dir, tiny_model_dir, demos), stop_at="sft_step:12")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert f"Resume with: mugrpo train --resume {run_dir}" in stopped.stderr
    assert (run_dir / "warmstart" / "final_model" / "config.json").is_file()
    assert not (run_dir / "stages").exists() and not (run_dir / "metrics.jsonl").exists()  # RL never started
    resumed = _mugrpo("train", "--resume", run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "warm start done earlier" in resumed.stdout and (run_dir / "final_model" / "config.json").is_file()


def test_sigterm_during_the_warm_start_ends_the_run_with_the_resume_command(tmp_path, tiny_model_dir, demos):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mugrpo", *map(str, _train_cmd(run_dir, tiny_model_dir, demos)),
           "warmstart.steps=100000", "warmstart.checkpoint_every=0"]  # hours of steps: only the stop ends it
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # one line per step without bars
        if line.startswith("[mugrpo] warm start step 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)  # a bound far above a step (~0.01 s), not a speed test
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not stop within 60 s of SIGTERM")
    assert proc.returncode == 130, err[-3000:]
    assert f"Resume with: mugrpo train --resume {run_dir}" in err
    assert any((run_dir / "warmstart" / "checkpoints").glob("ckpt_*")) and not (run_dir / "stages").exists()


@pytest.mark.slow  # ~11 s
def test_a_diverging_warm_start_stops_with_exit_2_and_writes_no_model(tmp_path, tiny_model_dir, demos):
    run_dir = tmp_path / "run"
    r = _mugrpo(*_train_cmd(run_dir, tiny_model_dir, demos), "warmstart.lr=1e9", "warmstart.epochs=1")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "warm start stopped at step 3 of 3: 2 of its 3 steps were skipped" in r.stderr
    assert "Traceback" not in r.stderr and not (run_dir / "warmstart" / "final_model").exists()
    # the skip warnings are numbered as the metrics number the steps (1-based), beside the step lines
    assert "warm-start step 2 skipped" in r.stdout and "warm start step 2/3: loss nan" in r.stdout
