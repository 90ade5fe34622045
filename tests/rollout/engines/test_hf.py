"""The HF engine's behaviour log-probs against the trainer's and against plain ``generate``; weight sharing."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from mugrpo.config import RolloutConfig
from mugrpo.stages.data import StageData
from mugrpo.kit.batching import collate
from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.engines.hf import HFEngine, left_pad
from mugrpo.kit.forward import response_logprobs
from mugrpo.models.loading import load_policy, load_tokenizer
from mugrpo.seeds import derive


def _prompts(tok):
    return [tok("u:Calculate 5 - 3.\na:")["input_ids"], tok("u:Hi\na:")["input_ids"], tok("u:1+1\na:")["input_ids"]]


def _engine(model_dir, tok, batch_size=64):
    # fp32 like the policy, so the parity tolerances below are fp32 rounding. (rollout.dtype defaults
    # to "auto", which the trainer resolves before it builds an engine.)
    return HFEngine(model_dir, tok, RolloutConfig(batch_size=batch_size, dtype="float32"))


def _trainer_logprobs(policy, prompts, completions, temperature):
    flat = [c for group in completions for c in group]
    n = len(flat)
    G = len(completions[0])
    data = StageData(prompts, [c.token_ids for c in flat], [c.behavior_logprobs for c in flat], torch.zeros(n),
                     torch.zeros(n), torch.ones(n, dtype=torch.bool), list(range(len(prompts))), G)
    mb = collate(data, list(range(n)), pad_id=0)
    with torch.no_grad():
        logprobs, _ = response_logprobs(policy, mb, temperature, False, False, False)
    return logprobs, mb


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_equal_trainer_logprobs(tiny_model_dir, temperature):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok, batch_size=5)  # 5 // G: one prompt per call
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
    engine = _engine(tiny_model_dir, tok)
    prompts = _prompts(tok)
    out = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, top_k=5, max_new_tokens=6, seed=0))
    logprobs, mb = _trainer_logprobs(policy, prompts, out, 1.0)
    gap = (mb.behavior_logprobs - logprobs)[mb.response_mask]
    assert (gap > 1e-3).all()  # 5 of 100 tokens of a near-uniform random model hold far less than all the mass


def test_weight_sync_changes_behavior_and_parity_holds_again(tiny_model_dir):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)
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
    engine = _engine(tiny_model_dir, tok)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=3)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = engine.generate(_prompts(tok), sampling)
    assert torch.equal(torch.get_rng_state(), state)
    b = engine.generate(_prompts(tok), sampling)
    assert [c.token_ids for g in a for c in g] == [c.token_ids for g in b for c in g]


def test_greedy_generation(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)
    policy = load_policy(tiny_model_dir)
    prompts = _prompts(tok)
    out = engine.generate(prompts, SamplingConfig(n=2, temperature=0.0, max_new_tokens=5))
    assert out[0][0].token_ids == out[0][1].token_ids
    assert all(math.isfinite(x) for x in out[0][0].behavior_logprobs)
    # Greedy log-probs are log_softmax of the raw logits (temperature 1) at the argmax token.
    logprobs, mb = _trainer_logprobs(policy, prompts, out, 1.0)
    assert ((logprobs - mb.behavior_logprobs)[mb.response_mask]).abs().max() < 1e-5
    assert sum(len(g[0].token_ids) for g in out) >= 6  # several steps to check, not one EOS per prompt
    for prompt, group in zip(prompts, out):
        assert group[0].token_ids == argmax_continuation(policy, prompt, group[0].token_ids)


def argmax_continuation(policy, prompt: list[int], tokens: list[int]) -> list[int]:
    """The argmax of the policy's logits at each position that predicts one of ``tokens`` (one
    causal forward over prompt + tokens: position P - 1 + t predicts token t)."""
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


def _cut_at_eos(tokens: list[int], logprobs: list[float], eos: int) -> tuple[list[int], list[float]]:
    end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
    return tokens[:end], logprobs[:end]


# All three warpers; and none at all, where a warper generate added on its own (e.g. its default
# top_k=50, half of the tiny vocabulary) would change the samples.
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.9), (1.0, 0, 1.0)])
def test_tokens_and_logprobs_equal_plain_generate_with_output_scores(tiny_model_dir, temperature, top_k, top_p):
    # n = 1 and every prompt in one call: the engine's call is the same generate call as the
    # reference, which lets generate build the warpers and returns the [B, T, V] processed scores.
    tok = load_tokenizer(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok, batch_size=64)
    prompts = _prompts(tok) * 2
    sampling = SamplingConfig(n=1, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=5)
    out = engine.generate(prompts, sampling)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    input_ids, attention = left_pad(prompts, tok.pad_token_id)
    cfg = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                           output_scores=True, return_dict_in_generate=True)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(derive(sampling.seed, "hf-generate-call", 0))  # the engine's seed for its first call
        ref = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=cfg)
    new_tokens = ref.sequences[:, input_ids.shape[1]:]
    scores = torch.stack(ref.scores, dim=1)  # [B, T, V] after temperature / top-k / top-p
    ref_logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    for row, group in enumerate(out):
        tokens, logprobs = _cut_at_eos(new_tokens[row].tolist(), ref_logprobs[row].tolist(), tok.eos_token_id)
        assert group[0].token_ids == tokens
        # The recorder takes the same processed scores through the same log_softmax: bit-identical.
        assert group[0].behavior_logprobs == logprobs


def test_shared_prefill_logprobs_equal_unpadded_recomputation(tiny_model_dir):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok, batch_size=8)  # 2 prompts x G=4 per call
    calls = []  # (rows, tokens) of every forward the engine's model runs
    engine.model.register_forward_pre_hook(lambda m, args, kw: calls.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    prompts = _prompts(tok)  # 21, 7 and 8 tokens: the first call (prompts 0 and 1) left-pads
    temperature = 0.7
    out = engine.generate(prompts, SamplingConfig(n=4, temperature=temperature, max_new_tokens=10, seed=2))
    # Each prompt is prefilled once: a forward over several tokens has one row per prompt (2, then 1);
    # only the one-token forwards run the 8 sequences of a call.
    assert sorted(rows for rows, length in calls if length > 1) == [1, 2]
    assert any(rows == 8 for rows, _ in calls)
    # Trainer-style recomputation, one sequence at a time (no padding at all).
    for prompt, group in zip(prompts, out):
        assert len({tuple(c.token_ids) for c in group}) > 1  # the G samples diverge after the shared prefix
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits / temperature, dim=-1).gather(
                -1, torch.tensor(c.token_ids).unsqueeze(-1)).squeeze(-1)
            # fp32 on both sides: summation-order rounding only.
            assert (torch.tensor(c.behavior_logprobs) - expected).abs().max() < 1e-5


def test_load_weights_shares_policy_storage_and_a_new_load_takes_effect(tiny_model_dir):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)
    engine.load_weights((n, p.detach()) for n, p in policy.named_parameters())
    engine_params = dict(engine.model.named_parameters())
    for name, p in policy.named_parameters():
        assert engine_params[name].data_ptr() == p.data_ptr(), name
    lm_head, embed = engine.model.lm_head.weight, engine.model.model.embed_tokens.weight
    assert lm_head.data_ptr() == embed.data_ptr() == policy.model.embed_tokens.weight.data_ptr()  # still tied

    prompts = _prompts(tok)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    before = engine.generate(prompts, sampling)
    gen = torch.Generator().manual_seed(0)
    perturbed = {n: p.detach() + 0.5 * torch.randn(p.shape, generator=gen) for n, p in policy.named_parameters()}
    engine.load_weights(perturbed.items())
    assert all(engine_params[n].data_ptr() == t.data_ptr() for n, t in perturbed.items())
    after = engine.generate(prompts, sampling)
    policy.load_state_dict(perturbed, strict=False)
    logprobs, mb = _trainer_logprobs(policy, prompts, after, 1.0)
    # Tolerance as in the weight-sync test above (sharper logits under the perturbed weights).
    assert ((logprobs - mb.behavior_logprobs)[mb.response_mask]).abs().max() < 1e-4
    assert [c.behavior_logprobs for g in before for c in g] != [c.behavior_logprobs for g in after for c in g]


def test_load_weights_copies_buffers_and_never_writes_into_a_previously_shared_tensor(tiny_model_dir):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)
    engine.load_weights((n, p.detach()) for n, p in policy.named_parameters())
    originals = {n: p.detach().clone() for n, p in policy.named_parameters()}
    # float64 tensors cannot be shared with the fp32 engine: they are copied, and the copy must not
    # land in the policy's storage that the engine shared until now.
    doubled = {n: 2 * p.detach().double() for n, p in policy.named_parameters()}
    engine.load_weights(doubled.items())
    engine_params = dict(engine.model.named_parameters())
    for name, p in policy.named_parameters():
        assert torch.equal(p, originals[name]), name
        assert engine_params[name].data_ptr() != p.data_ptr()
        assert torch.equal(engine_params[name], doubled[name].float())
    inv_freq = dict(engine.model.named_buffers())["model.rotary_emb.inv_freq"]
    incoming = inv_freq.clone() * 3
    engine.load_weights([("model.rotary_emb.inv_freq", incoming)])
    assert inv_freq.data_ptr() != incoming.data_ptr() and torch.equal(inv_freq, incoming)
