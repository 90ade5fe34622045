"""A run's persisted stages (mugrpo.stages.store): the stage statistics by hand, and a stage saved
then read back with its metrics, in one process."""
import math

import pytest
import torch

from mugrpo.algo.losses import LossSettings
from mugrpo.config.schema import LossConfig
from mugrpo.kit import distributed as dist
from mugrpo.kit.update import StepSettings
from mugrpo.run_dir import SHARDS_FILE, RunDir
from mugrpo.stages.data import ENV_TURN, StageData
from mugrpo.stages.store import StageStore, stage_stats

pytestmark = pytest.mark.unit


def _step(**loss) -> StepSettings:
    return StepSettings(loss=LossSettings.from_config(LossConfig(**loss), seq_len_norm=8), temperature=1.0,
                        autocast=False, skip_zero_advantage=False, shared_prefix=False, micro_batch_tokens=256,
                        micro_batch_size=None)


def _data(**extra) -> StageData:
    # 2 groups of G = 2; response lengths 3, 5, 2, 2; rewards [1, 0 | 1, 1]; the 2nd sequence truncated
    responses = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16]]
    return StageData([[1, 2], [3]], responses, [[-1.0] * len(r) for r in responses],
                     torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.7, -0.7, 0.0, 0.0]),
                     torch.tensor([True, False, True, True]), [4, 9], 2, **extra)


def test_stage_stats_by_hand():
    stats = stage_stats(_data(), dist.World())
    assert stats["reward/mean"] == pytest.approx(0.75)  # (1 + 0 + 1 + 1) / 4
    # population std: sqrt(mean(r^2) - mean^2) = sqrt(0.75 - 0.5625) = sqrt(0.1875) = 0.4330
    assert stats["reward/std"] == pytest.approx(math.sqrt(0.1875), rel=1e-6)
    assert stats["stage/response_len_mean"] == pytest.approx(3.0)  # (3 + 5 + 2 + 2) / 4
    assert stats["stage/truncated_frac"] == pytest.approx(0.25)  # 1 of 4 did not finish
    assert (stats["stage/num_sequences"], stats["stage/num_groups"]) == (4, 2)
    assert stats["stage/zero_var_group_frac"] == pytest.approx(0.5)  # group 1 (rewards 1, 1) of 2
    assert "stage/policy_len_mean" not in stats  # single-turn data


def test_stage_stats_of_multi_turn_data_count_policy_tokens():
    turns = [[0, 0, 0], [0, ENV_TURN, ENV_TURN, 1, 1], [0, 0], [0, 0]]
    stats = stage_stats(_data(turns=turns), dist.World())
    # policy tokens 3 + 3 + 2 + 2 = 10 over 4 sequences; the response length still counts all 12
    assert stats["stage/policy_len_mean"] == pytest.approx(2.5)
    assert stats["stage/response_len_mean"] == pytest.approx(3.0)


def test_a_saved_stage_reads_back_with_its_metrics(tmp_path):
    written = []
    store = StageStore(RunDir(tmp_path / "run"), dist.World(), _step(),
                       write_text=lambda path, data: written.append(path))
    stage_dir = store.stage_dir(0)
    assert stage_dir == tmp_path / "run" / "stages" / "stage_000"
    assert store.load(stage_dir) is None  # nothing on disk: the stage must be generated
    data = _data()
    store.save(stage_dir, data, {"reward/mean": 0.9, "gen/num_rounds": 2})
    assert (stage_dir / SHARDS_FILE).is_file()
    assert written == [RunDir.stage_text(stage_dir, dist.World())]
    back, metrics = store.load(stage_dir)
    assert back.responses == data.responses and back.rewards.equal(data.rewards)
    assert back.finished.equal(data.finished) and back.item_indices == [4, 9]
    # the saved metrics win over the recomputed stats (dynamic sampling's reward/mean covers every round)
    assert metrics["reward/mean"] == 0.9 and metrics["gen/num_rounds"] == 2
    assert metrics["stage/truncated_frac"] == pytest.approx(0.25)
    assert not any(k.startswith("stage/tis") for k in metrics)  # engine log-probs: no mismatch metrics


def test_trainer_logprobs_add_the_mismatch_metrics_on_load(tmp_path):
    store = StageStore(RunDir(tmp_path / "run"), dist.World(), _step(behavior_logprobs="trainer"))
    # trainer log-prob -0.5 against the engine's -1.0 on all 12 tokens: d = 0.5, w = e^0.5 = 1.6487 < C = 2
    data = _data(trainer_logprobs=[[-0.5] * n for n in (3, 5, 2, 2)])
    store.save(store.stage_dir(1), data, {})
    _, metrics = store.load(store.stage_dir(1))
    assert metrics["stage/num_recomputed_tokens"] == 12
    assert metrics["stage/engine_trainer_log_ratio_abs_mean"] == pytest.approx(0.5)
    assert metrics["stage/tis_weight_mean"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert metrics["stage/tis_capped_frac"] == 0.0
    # k3(0.5) = e^0.5 - 0.5 - 1 = 0.148721
    assert metrics["stage/engine_trainer_kl"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)
