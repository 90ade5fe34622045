"""RunDir names the run directory's files; they must stay those older runs wrote, so those keep resuming."""
from pathlib import Path

from mugrpo.run_dir import RunDir, shard_path, text_path
import pytest

pytestmark = pytest.mark.unit


def test_names_on_disk_are_those_of_earlier_versions():
    rd = RunDir("run")
    assert (rd.config, rd.metrics, rd.lock) == (Path("run/config.yaml"), Path("run/metrics.jsonl"), Path("run/.lock"))
    assert (rd.checkpoints, rd.final_model) == (Path("run/checkpoints"), Path("run/final_model"))
    assert rd.stage(7) == Path("run/stages/stage_007")
    assert shard_path(rd.stage(0), 1) == Path("run/stages/stage_000/rollouts_rank1.safetensors")
    assert text_path(rd.stage(0), 0, 1) == Path("run/stages/stage_000/rollouts.jsonl")
    assert text_path(rd.stage(0), 1, 2) == Path("run/stages/stage_000/rollouts_rank1.jsonl")


def test_stage_metrics_round_trip_and_an_old_stage_dir_reads_as_empty(tmp_path):
    RunDir.write_stage_metrics(tmp_path / "stage_000", {"reward/num_errors": 3, "reward/unparsable_frac": 0.25})
    assert RunDir.read_stage_metrics(tmp_path / "stage_000") == {"reward/num_errors": 3, "reward/unparsable_frac": 0.25}
    assert not [p for p in (tmp_path / "stage_000").iterdir() if ".tmp-" in p.name]  # written atomically
    assert RunDir.read_stage_metrics(tmp_path / "stage_001") == {}
