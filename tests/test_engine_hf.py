"""The HF engine's behaviour log-probs against the trainer's, on the same weights and tokens."""
import math

import pytest
import torch

from mugrpo.config import RolloutConfig
from mugrpo.data import StageData, collate
from mugrpo.engines.base import SamplingConfig
from mugrpo.engines.hf import HFEngine
from mugrpo.models import load_policy, load_tokenizer
from mugrpo.trainer import sequence_logprobs


def _prompts(tok):
    return [tok("u:Calculate 5 - 3.\na:")["input_ids"], tok("u:Hi\na:")["input_ids"], tok("u:1+1\na:")["input_ids"]]


def _trainer_logprobs(policy, prompts, completions, temperature):
    flat = [c for group in completions for c in group]
    n = len(flat)
    G = len(completions[0])
    data = StageData(prompts, [c.token_ids for c in flat], [c.behavior_logprobs for c in flat], torch.zeros(n),
                     torch.zeros(n), torch.ones(n, dtype=torch.bool), list(range(len(prompts))), G)
    mb = collate(data, list(range(n)), pad_id=0)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(policy, mb, temperature, False, False, False)
    return logprobs, mb


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_trainer_logprobs(tiny_model_dir, temperature):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, tok, RolloutConfig(batch_size=5))  # batches split groups: 12 seqs / 5
    prompts = _prompts(tok)
    out = engine.generate(prompts, SamplingConfig(n=4, temperature=temperature, max_new_tokens=12, seed=1))
    assert [len(g) for g in out] == [4, 4, 4]
    logprobs, mb = _trainer_logprobs(policy, prompts, out, temperature)
    delta = (logprobs - mb.behavior_logprobs)[mb.response_mask]
    # fp32, same weights: only summation-order rounding separates the two (observed ~5e-7).
    assert delta.abs().max() < 1e-5
    for group in out:
        for c in group:
            assert len(c.token_ids) == len(c.behavior_logprobs) and c.finish_reason in ("stop", "length")
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)


def test_top_k_logprobs_are_of_the_truncated_distribution(tiny_model_dir):
    # Sampling from the top-k renormalised distribution: log p_k(y) = log p(y) - log(mass of the top k) >= log p(y).
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, tok, RolloutConfig())
    prompts = _prompts(tok)
    out = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, top_k=5, max_new_tokens=6, seed=0))
    logprobs, mb = _trainer_logprobs(policy, prompts, out, 1.0)
    gap = (mb.behavior_logprobs - logprobs)[mb.response_mask]
    assert (gap > 1e-3).all()  # 5 of 100 tokens of a near-uniform random model hold far less than all the mass


def test_weight_sync_changes_behavior_and_parity_holds_again(tiny_model_dir):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, tok, RolloutConfig())
    prompts = _prompts(tok)
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=10, seed=7)
    before = engine.generate(prompts, sampling)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.load_weights((n, p.detach()) for n, p in policy.named_parameters())
    after = engine.generate(prompts, sampling)
    logprobs, mb = _trainer_logprobs(policy, prompts, after, 1.0)
    # The perturbed weights give sharper logits (|log p| up to ~20), so fp32 rounding grows to ~1e-5;
    # a sync that silently did nothing would leave deltas of order 1 (noise std 0.5 on every weight).
    assert ((logprobs - mb.behavior_logprobs)[mb.response_mask]).abs().max() < 1e-4
    # Same seed, new weights: the samples (or at least their log-probs) must differ.
    assert [c.behavior_logprobs for g in before for c in g] != [c.behavior_logprobs for g in after for c in g]


def test_generation_is_seeded_and_leaves_global_rng_alone(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, tok, RolloutConfig())
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = engine.generate(_prompts(tok), sampling)
    assert torch.equal(torch.get_rng_state(), state)
    b = engine.generate(_prompts(tok), sampling)
    assert [c.token_ids for g in a for c in g] == [c.token_ids for g in b for c in g]


def test_greedy_generation(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, tok, RolloutConfig())
    out = engine.generate(_prompts(tok), SamplingConfig(n=2, temperature=0.0, max_new_tokens=5))
    assert out[0][0].token_ids == out[0][1].token_ids
    assert all(math.isfinite(x) for x in out[0][0].behavior_logprobs)
