"""The update step's rules outside the loss (mugrpo.kit.update): the normaliser on hand-built stage
data, which log-probs a ratio is taken against, the zero-advantage skip, the micro-batch layout."""
import dataclasses
import math

import pytest
import torch

from mugrpo.algo.losses import LossSettings
from mugrpo.config.schema import LossConfig
from mugrpo.kit.batching import MicroBatch
from mugrpo.kit.update import StepSettings, normaliser, ratio_inputs
from mugrpo.stages.data import ENV_TURN, StageData

pytestmark = pytest.mark.unit


def _step(**loss) -> StepSettings:
    settings = LossSettings.from_config(LossConfig(**loss), seq_len_norm=8)
    return StepSettings(loss=settings, temperature=1.0, autocast=False, skip_zero_advantage=True,
                        shared_prefix=False, micro_batch_tokens=256, micro_batch_size=None)


def _data(turns=None) -> StageData:
    # 1 group of G = 2: responses of 3 and 5 tokens; advantages [0.5, 0.0]
    responses = [[5, 6, 7], [8, 9, 10, 11, 12]]
    return StageData([[1, 2]], responses, [[-1.0] * len(r) for r in responses], torch.tensor([1.0, 0.0]),
                     torch.tensor([0.5, 0.0]), torch.tensor([True, True]), [0], 2, turns=turns)


def test_token_mean_counts_every_policy_token_of_every_sequence():
    data, step = _data(), _step(aggregation="token-mean")
    # 3 + 5 = 8 tokens; no post-veto, so no forward: no policy needed
    n = normaliser(None, data, [0, 1], trained=[0], batches=[], real=0, step=step)
    assert n.item() == 8.0
    # counted over the sequences asked for, trained or skipped: only sequence 1 -> 5
    assert normaliser(None, data, [1], trained=[], batches=[], real=0, step=step).item() == 5.0


def test_environment_tokens_are_not_counted():
    # sequence 1's tokens 3 and 4 are an environment's reply: 5 - 2 = 3 policy tokens; 3 + 3 = 6
    data = _data(turns=[[0, 0, 0], [0, 0, 0, ENV_TURN, ENV_TURN]])
    assert normaliser(None, data, [0, 1], trained=[0, 1], batches=[], real=0, step=_step()).item() == 6.0


def test_seq_mean_counts_sequences():
    step = _step(aggregation="seq-mean-token-mean")
    assert normaliser(None, _data(), [0, 1], trained=[0, 1], batches=[], real=0, step=step).item() == 2.0


def test_the_zero_advantage_skip_is_exact_only_without_kl_or_entropy():
    data = _data()
    assert _step().skip and _step().to_train(data, [0, 1]) == [0]  # sequence 1 has A = 0
    with_kl = _step(kl_beta=0.1)
    assert not with_kl.skip and with_kl.to_train(data, [0, 1]) == [0, 1]  # A = 0 still moves the KL term
    off = dataclasses.replace(_step(), skip_zero_advantage=False)
    assert off.to_train(data, [0, 1]) == [0, 1]


def test_layout_without_shared_prefix_needs_no_model():
    assert _step().layout(None) == dict(shared=False, budget=256, max_seqs=None, pad_id=0, mask_dtype=torch.bool)


def _mb(trainer=None) -> MicroBatch:
    zeros = torch.zeros(1, 4, dtype=torch.long)
    return MicroBatch(zeros, torch.ones(1, 4, dtype=torch.long), zeros, torch.zeros(1, 2, dtype=torch.long),
                      torch.ones(1, 2, dtype=torch.bool), torch.tensor([[-1.5, -1.5]]), torch.tensor([1.0]),
                      trainer_logprobs=trainer)


def test_ratio_against_the_engines_logprobs_has_no_weight():
    mb = _mb()
    against, weights = ratio_inputs(mb, _step().loss)
    assert against is mb.behavior_logprobs and weights is None


def test_ratio_against_the_trainers_logprobs_carries_the_tis_weight():
    mb = _mb(trainer=torch.tensor([[-1.0, -0.5]]))
    against, weights = ratio_inputs(mb, _step(behavior_logprobs="trainer", tis_cap=2.0).loss)
    assert against is mb.trainer_logprobs
    # trainer - engine = [0.5, 1.0]: e^0.5 = 1.6487; e^1 = 2.718 capped at C = 2
    assert weights.tolist()[0] == pytest.approx([math.exp(0.5), 2.0], rel=1e-6)
    with pytest.raises(ValueError, match="loss.behavior_logprobs=trainer but the stage data carries no trainer"):
        ratio_inputs(_mb(), _step(behavior_logprobs="trainer").loss)
