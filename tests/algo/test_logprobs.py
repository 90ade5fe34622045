"""Token log-probs and entropy at a sampling temperature (mugrpo.algo.logprobs) on tiny logits,
computed by hand."""
import math

import pytest
import torch

from mugrpo.algo.logprobs import token_entropy, token_logprobs

pytestmark = pytest.mark.unit

# One sequence of two positions over a vocabulary of 2 (position 0) logits [0, ln 3]: p = [1/4, 3/4];
# position 1 logits [0, 0]: p = [1/2, 1/2].
LOGITS = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])


def test_token_logprobs_pick_the_token_of_the_log_softmax():
    tokens = torch.tensor([[1, 0]])
    logp, entropy = token_logprobs(LOGITS, tokens)
    # log 3/4 = -0.287682; log 1/2 = -0.693147
    assert logp.tolist()[0] == pytest.approx([math.log(0.75), math.log(0.5)], rel=1e-6)
    assert entropy is None


def test_token_logprobs_at_a_temperature_and_their_entropy():
    tokens = torch.tensor([[0, 1]])
    logp, entropy = token_logprobs(LOGITS, tokens, temperature=0.5, with_entropy=True)
    # T = 0.5 doubles the logits: [0, 2 ln 3] -> p = [1/10, 9/10]; [0, 0] stays [1/2, 1/2]
    assert logp.tolist()[0] == pytest.approx([math.log(0.1), math.log(0.5)], rel=1e-6)
    # H = -(0.1 ln 0.1 + 0.9 ln 0.9) = 0.230259 + 0.094824 = 0.325083; H of a fair coin = ln 2
    h0 = -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))
    assert entropy.tolist()[0] == pytest.approx([h0, math.log(2.0)], rel=1e-6)


def test_token_logprobs_compute_bf16_logits_in_float32_and_keep_float64():
    tokens = torch.tensor([[1, 0]])
    assert token_logprobs(LOGITS.bfloat16(), tokens)[0].dtype == torch.float32
    assert token_logprobs(LOGITS.double(), tokens)[0].dtype == torch.float64


def test_token_entropy_in_chunks_equals_the_whole():
    # [0, ln 3] -> p = [1/4, 3/4]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    got = token_entropy(LOGITS, chunk=1)  # one position per chunk: the loop's two passes
    assert got.shape == (1, 2)
    assert got.tolist()[0] == pytest.approx([h, math.log(2.0)], rel=1e-6)
    # a uniform distribution over 4 at any temperature: ln 4
    assert token_entropy(torch.zeros(3, 4), temperature=0.7).tolist() == pytest.approx([math.log(4.0)] * 3, rel=1e-6)
