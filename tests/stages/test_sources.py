"""Where a stage's data comes from (mugrpo.stages.sources): the replay choice and a resumed replay
that reads its own copy, never the source; the store the run builds. No model is loaded."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mugrpo.algo.losses import LossSettings
from mugrpo.config.schema import Config, LossConfig
from mugrpo.kit import distributed as dist
from mugrpo.kit.update import StepSettings
from mugrpo.run_dir import RunDir
from mugrpo.stages.data import StageData
from mugrpo.stages.replay import ReplayError
from mugrpo.stages.sources import ReplayedStages, build_stage_source, build_store
from mugrpo.stages.store import StageStore

pytestmark = pytest.mark.unit


def _step(behavior="engine") -> StepSettings:
    return StepSettings(loss=LossSettings.from_config(LossConfig(behavior_logprobs=behavior), seq_len_norm=8),
                        temperature=1.0, autocast=False, skip_zero_advantage=False, shared_prefix=False,
                        micro_batch_tokens=256, micro_batch_size=None)


def _data() -> StageData:
    # 1 group of G = 2: rewards [1, 0]
    return StageData([[1, 2]], [[5, 6], [7]], [[-1.0, -1.0], [-1.0]], torch.tensor([1.0, 0.0]),
                     torch.tensor([0.7, -0.7]), torch.tensor([True, True]), [3], 2)


@pytest.mark.parametrize("behavior, needs", [("engine", False), ("trainer", True)])
def test_a_replay_builds_a_replayed_source_that_knows_whether_it_needs_trainer_logprobs(tmp_path, behavior, needs):
    store = StageStore(RunDir(tmp_path / "run"), dist.World(), _step(behavior))
    source = build_stage_source(Config(), None, dist.World(), None, None, store, None, replay=tmp_path / "src")
    assert isinstance(source, ReplayedStages)
    assert source.need_trainer_logprobs is needs


def test_a_resumed_replay_reads_its_own_copy_and_never_the_source(tmp_path):
    store = StageStore(RunDir(tmp_path / "run"), dist.World(), _step())
    store.save(store.stage_dir(0), _data(), {})
    # the source path does not exist: reading it would fail, so stage 0 must come from the run's own copy
    source = ReplayedStages(tmp_path / "gone", Config(), store, dist.World(), None, need_trainer_logprobs=False)
    data, metrics = source.stage(SimpleNamespace(stage=0))
    assert data.responses == [[5, 6], [7]]
    assert (metrics["stage/resumed"], metrics["stage/replayed"]) == (1.0, 1.0)
    assert metrics["reward/mean"] == pytest.approx(0.5)  # (1 + 0) / 2
    # stage 1 is not copied yet: the recorded source is checked now, and it is not a run directory
    with pytest.raises(ReplayError, match=r"replay source .*gone' is not a directory"):
        source.stage(SimpleNamespace(stage=1))


def test_build_store_writes_the_readable_text_only_when_asked(tmp_path):
    cfg = Config()
    run = RunDir(tmp_path / "run")
    assert build_store(cfg, dist.World(), None, run, _step()).write_text is not None  # train.save_stage_text=true
    cfg.train.save_stage_text = False
    store = build_store(cfg, dist.World(), None, run, _step())
    assert store.write_text is None and store.run_dir is run and isinstance(store.run_dir.path, Path)
