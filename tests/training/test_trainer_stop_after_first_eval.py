"""mugrpo.training.trainer.train and a stop between its phases: a SIGTERM
that ends the first evaluation (eval.at_start) ends the run there, before stage 0's generation; it
used to go on into the generation until its first decode step's stop check (45 s on a loaded CPU).
Real subprocess runs of the tiny model; the stop placed by ``MUGRPO_STOP_AT``."""
from training.test_stop_during_eval import _cmd, _records, _run


def test_a_stop_in_the_first_evaluation_does_not_start_stage_0(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    # A SIGTERM inside the evaluation of update 0, and a second one at the first decode step of a stage's
    # generation: reaching that generation would abort at once (exit -15) instead of stopping cleanly.
    stopped = _run(_cmd(run_dir, tiny_model_dir), stop_at="eval:3,decode:1")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert f"Resume with: mugrpo train --resume {run_dir}" in stopped.stderr
    assert "second SIGTERM" not in stopped.stdout
    assert _records(run_dir, "eval") == [] and not (run_dir / "stages" / "stage_000").exists()
