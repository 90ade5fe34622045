"""The exact speed-ups of the optimisation phase (mugrpo.kit.batching, mugrpo.kit.forward) against the plain path.

Shared-prefix rows, the zero-advantage skip and token-budget micro-batches must give the plain
path's per-token log-probs and every parameter's gradient: in float32 to a relative 1e-5, in float64
to a relative 1e-12 (with :func:`exact_rmsnorm`, see there).
"""
import pytest
import torch
from conftest import TINY_OVERRIDES

from mugrpo.kit.batching import block_mask, make_rows, micro_batches, pack_rows, sequences_to_train
from mugrpo.config import load_config
from mugrpo.stages.data import StageData
from mugrpo.kit.batching import collate
from mugrpo.kit.distributed import World
from mugrpo.kit.forward import response_logprobs, shared_prefix_support
from mugrpo.models.loading import load_policy
from mugrpo.config.plan import make_plan
from mugrpo.stages.state import RLState
from mugrpo.training.trainer import Trainer

FP64_TOL = 1e-12
"""Relative tolerance of the float64 comparisons. Two equally valid float64 summation orders differ by
a few eps (1.1e-16) relative: measured up to 1e-15 here (2026-12-01). 1e-12 leaves a 1000x margin, and
any float32-sized difference (>= 1e-8, e.g. the 1.6e-7 once seen on SmolLM2) fails by four orders."""


@pytest.fixture
def exact_rmsnorm(monkeypatch):
    """Llama's RMSNorm computed in its input's dtype, for float64 exactness tests.

    transformers' ``LlamaRMSNorm`` rounds its input to float32 and back, whatever the model's dtype,
    so a float64 model runs every norm (forward and backward) at float32 precision. The shared-prefix
    layout sums the G responses' gradients at a prompt position BEFORE that float32 backward, the
    plain layout after it: both are right, and they differ by float32 rounding (4e-8 relative on
    the tiny model, 1.6e-7 on SmolLM2: the whole difference once seen). With the norm in
    float64 the two layouts agree to 1e-15. In float32 this is the stock computation, op for op.
    """
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def _stage(vocab: int, prompt_lens, response_lens, G: int, advantages=None, seed: int = 0) -> StageData:
    """Random tokens: groups with the given prompt lengths, G responses each with the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in response_lens]
    behavior = [(-torch.rand(n, generator=gen) * 3).tolist() for n in response_lens]
    S = len(response_lens)
    adv = torch.tensor(advantages, dtype=torch.float32) if advantages is not None else torch.randn(S, generator=gen)
    return StageData(prompts, responses, behavior, torch.zeros(S), adv, torch.ones(S, dtype=torch.bool),
                     list(range(len(prompt_lens))), G)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _logprobs_and_grads(model, mb, weights):
    """Per-token log-probs [S, R] and the gradient of sum(weights * logprobs) for every parameter."""
    model.zero_grad(set_to_none=True)
    logprobs, _ = response_logprobs(model, mb, 1.0, False, False, False)
    (logprobs * weights * mb.response_mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logprobs.detach(), grads


def _check_shared_equals_plain(model, data: StageData, budget: int, grad_tol: float = 1e-5, lp_tol: float = 1e-5):
    supported, mask_dtype, reason = shared_prefix_support(model)
    assert supported, reason
    seqs = list(range(len(data.responses)))
    plain = collate(data, seqs, pad_id=0)
    dtype = next(model.parameters()).dtype
    weights = torch.randn(plain.response_ids.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    plain.behavior_logprobs = plain.behavior_logprobs.to(dtype)
    ref_lp, ref_grads = _logprobs_and_grads(model, plain, weights)
    shared = micro_batches(data, seqs, shared=True, budget=budget, max_seqs=None, pad_id=0, mask_dtype=mask_dtype)
    grads = {n: torch.zeros_like(g) for n, g in ref_grads.items()}
    lp = torch.zeros_like(ref_lp)
    for mb in shared:
        # The micro-batch's sequences, in its order, are the rows' sequences; map them back.
        order = [s for s in _seqs_of(mb, data)]
        w = weights[order, :mb.response_len]
        lp_mb, g_mb = _logprobs_and_grads(model, mb, w)
        lp[order, :mb.response_len] = lp_mb
        for n in grads:
            grads[n] += g_mb[n]
    mask = plain.response_mask
    torch.testing.assert_close(lp[mask], ref_lp[mask], rtol=lp_tol, atol=lp_tol / 10)
    for name, g in ref_grads.items():
        assert _relative_error(grads[name], g) <= grad_tol, name
    return shared


def _seqs_of(mb, data: StageData) -> list[int]:
    """Which stage sequences a shared micro-batch holds (matched by response tokens, all distinct here)."""
    index = {tuple(r): s for s, r in enumerate(data.responses)}
    out = []
    for row, n in zip(mb.response_ids, mb.response_mask.sum(1)):
        out.append(index[tuple(row[:int(n)].tolist())])
    return out


def test_block_mask_by_hand():
    # One row: prompt (2 tokens), response 1 (2 tokens), response 2 (1 token), 1 padding position.
    segment = torch.tensor([[0, 0, 1, 1, 2, -1]])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # prompt token 0: itself
        [1, 1, 0, 0, 0, 0],  # prompt token 1: causal over the prompt
        [1, 1, 1, 0, 0, 0],  # response 1, token 0: prompt + itself
        [1, 1, 1, 1, 0, 0],  # response 1, token 1: prompt + response 1
        [1, 1, 0, 0, 1, 0],  # response 2: prompt + itself, never response 1
        [0, 0, 0, 0, 0, 1],  # padding: itself only (no empty softmax row)
    ], dtype=torch.bool)
    assert torch.equal(block_mask(segment)[0, 0], expected)
    additive = block_mask(segment, torch.float32)[0, 0]
    assert additive[4, 2] == torch.finfo(torch.float32).min and additive[4, 4] == 0


def test_rows_split_groups_and_pack_by_tokens():
    # G = 3; group 0: prompt 4, responses 3, 5, 2; group 1: prompt 2, responses 1, 1, 6.
    data = _stage(20, [4, 2], [3, 5, 2, 1, 1, 6], G=3)
    # Budget 10, shared rows (prompt + responses): group 0's 4 + 3 = 7 fits; adding 5 makes 12, so
    # response 1 starts a row (4 + 5 = 9); adding 2 makes 11, so response 2 starts one (6). Group 1:
    # 2 + 1 + 1 + 6 = 10 fits in one row.
    rows = make_rows(data, list(range(6)), shared=True, budget=10)
    assert rows == [(0, [0]), (0, [1]), (0, [2]), (1, [3, 4, 5])]
    # Packing, longest first (10, 9, 7, 6): any two rows cost 2 x >= 6 x ... > 10, so each is alone.
    batches = pack_rows(data, rows, shared=True, budget=10, max_seqs=None)
    assert [[r[1] for r in b] for b in batches] == [[[3, 4, 5]], [[1]], [[0]], [[2]]]
    # Budget 20: group 0 is one row (4 + 3 + 5 + 2 = 14), group 1 one row (10); 2 x 14 = 28 > 20.
    batches = pack_rows(data, make_rows(data, list(range(6)), True, 20), shared=True, budget=20, max_seqs=None)
    assert [[r[1] for r in b] for b in batches] == [[[0, 1, 2]], [[3, 4, 5]]]
    # Plain rows pad prompt and response apart: rows x (longest prompt + longest response). Longest
    # first: s1 (4+5), s5 (2+6) -> 2 x (4+6) = 20 fits; s0 (4+3) -> 3 x 10 > 20, new; s2 (4+2) -> 2 x 7
    # fits; s3 (2+1) -> 3 x 7 > 20, new; s4 -> 2 x 3 fits. max_seqs=2 caps nothing further here.
    plain = pack_rows(data, make_rows(data, list(range(6)), False, 20), shared=False, budget=20, max_seqs=2)
    assert [[ss[0] for _, ss in b] for b in plain] == [[1, 5], [0, 2], [3, 4]]


def test_zero_advantage_sequences_are_not_trained():
    data = _stage(20, [3, 3], [2, 2, 2, 2], G=2, advantages=[0.0, 0.0, 1.0, -1.0])
    assert sequences_to_train(data, [0, 1, 2, 3], True) == [2, 3]
    assert sequences_to_train(data, [0, 1, 2, 3], False) == [0, 1, 2, 3]


@pytest.mark.parametrize("budget,dtype", [(4096, torch.float32), (40, torch.float32), (40, torch.float64)])
def test_shared_prefix_matches_plain_on_tiny_model(tiny_model_dir, exact_rmsnorm, budget, dtype):
    model = load_policy(tiny_model_dir, dtype=dtype)
    # Prompts of different lengths, responses of different lengths (left-padding in the plain path).
    data = _stage(model.config.vocab_size, [7, 12, 5], [3, 9, 1, 6, 4, 4, 2, 11, 8], G=3)
    tol = 1e-5 if dtype == torch.float32 else FP64_TOL
    batches = _check_shared_equals_plain(model, data, budget, grad_tol=tol, lp_tol=tol)
    assert (len(batches) == 1) if budget == 4096 else (len(batches) > 1)  # 40 tokens: split rows, several batches


@pytest.mark.slow  # ~30 s; the tiny-model cases above check the same exactness
def test_shared_prefix_matches_plain_on_smollm2(exact_rmsnorm):
    from mugrpo.models.loading import resolve_model_path

    # float64 with the norm in float64 (exact_rmsnorm): the 30-layer model's float32 rounding floor
    # (two valid micro-batch splits of the PLAIN path differ by 1.2e-5 in float32) would hide a
    # layout error below 1e-5. Measured here: 7e-15 relative overall, 3e-14 on the worst parameter.
    model = load_policy(resolve_model_path("smollm2-135m-instruct"), dtype=torch.float64)
    assert model.config.model_type == "llama"
    data = _stage(model.config.vocab_size, [40, 33], [6, 9, 3, 7, 5, 8, 4, 2], G=4)
    _check_shared_equals_plain(model, data, budget=4096, grad_tol=FP64_TOL, lp_tol=FP64_TOL)


def _update(tiny_model_dir, data, overrides, optimizer_cls=torch.optim.SGD, policy=None, **opt_kwargs):
    """One Trainer.update from a perturbed float64 policy (the tiny model unless ``policy`` is
    given); returns (parameter change, metrics).

    float64, so that equality up to rounding can be asserted tightly: in float32 the tiny model's
    layer-norm gradients (sums with heavy cancellation) differ by up to 4e-5 relative between two
    equally valid summation orders; in float64 (with :func:`exact_rmsnorm`) the paths agree to 1e-15."""
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES, "schedule.total_updates=4",
                                            "schedule.num_stages=1", "schedule.prompts_per_update=4",
                                            "optim.max_grad_norm=1e9", *overrides])
    policy = policy if policy is not None else load_policy(tiny_model_dir, dtype=torch.float64)
    torch.manual_seed(0)
    with torch.no_grad():  # away from the behaviour policy, so ratios, clipping and the veto are live
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    optimizer = optimizer_cls(policy.parameters(), **opt_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = [p.detach().clone() for p in policy.parameters()]
    trainer = Trainer(cfg, make_plan(cfg), World(), policy, optimizer, scheduler, device=torch.device("cpu"),
                      state=RLState(stage=0, update_in_stage=0))
    metrics = trainer.update(data)
    return [b - p.detach() for b, p in zip(before, policy.parameters())], metrics


PLAIN = ["train.skip_zero_advantage=false", "train.shared_prefix=false", "schedule.micro_batch_tokens=100000"]


@pytest.mark.parametrize("extra", [[], ["loss.veto_normalizer=post_veto"], ["loss.aggregation=seq-mean-token-mean"],
                                   ["schedule.micro_batch_tokens=48"]])
def test_update_equals_the_plain_path(tiny_model_dir, exact_rmsnorm, extra):
    # 4 groups of G = 8: two with zero variance (all A = 0), two mixed.
    G = 8
    adv = [0.0] * 8 + [1.0, -1.0] * 4 + [0.0] * 8 + [-0.5, 1.5, -0.5, -0.5, 1.5, -0.5, -0.5, -0.5]
    data = _stage(100, [9, 14, 6, 11], [(3 * s) % 13 + 1 for s in range(4 * G)], G=G, advantages=adv)
    plain, plain_metrics = _update(tiny_model_dir, data, PLAIN + extra, lr=1.0)  # SGD lr 1: change = -gradient
    fast, fast_metrics = _update(tiny_model_dir, data, extra, lr=1.0)
    assert fast_metrics["loss/trained_seq_frac"] == 0.5 and plain_metrics["loss/trained_seq_frac"] == 1.0
    for a, b in zip(fast, plain):
        assert _relative_error(a, b) <= FP64_TOL
    assert fast_metrics["loss/policy"] == pytest.approx(plain_metrics["loss/policy"], rel=FP64_TOL)
    # Vetoes and ratios of A != 0 sequences are the same; the skipped ones have neither.
    assert fast_metrics["loss/ratio_mean_neg"] == pytest.approx(plain_metrics["loss/ratio_mean_neg"], rel=1e-5)


def test_all_zero_variance_update_still_steps_adamw(tiny_model_dir):
    # Every advantage is 0: no forward at all, yet AdamW steps exactly as on the plain path's zero
    # gradient (its step count advances and weight decay moves the parameters).
    data = _stage(100, [9, 14, 6, 11], [4] * 32, G=8, advantages=[0.0] * 32)
    fast, metrics = _update(tiny_model_dir, data, [], torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain, _ = _update(tiny_model_dir, data, PLAIN, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    assert metrics["loss/trained_seq_frac"] == 0.0 and metrics["optim/skipped"] == 0.0
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b)
    assert any(float(a.abs().max()) > 0 for a in fast)  # weight decay moved them


def _gpt2(vocab: int = 100):
    """A float64 GPT-2 of one layer: a family the block mask is not checked for (the fallback's case)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel(config).to(torch.float64).eval()


def test_unsupported_model_falls_back_to_the_plain_path(tiny_model_dir):
    supported, _, reason = shared_prefix_support(_gpt2())
    assert not supported and "gpt2" in reason
    # A real update with train.shared_prefix on (the default) runs the plain layout on GPT-2 and must
    # step exactly as the plain reference (no skip, no sharing, one micro-batch). Had the fallback
    # fed GPT-2 the 4-D block mask or the packed rows, its positions and logits would differ at O(1).
    G = 8
    adv = [0.0] * 8 + [1.0, -1.0] * 4 + [0.0] * 8 + [-0.5, 1.5, -0.5, -0.5, 1.5, -0.5, -0.5, -0.5]
    data = _stage(100, [9, 14, 6, 11], [(3 * s) % 13 + 1 for s in range(4 * G)], G=G, advantages=adv)
    fallback, metrics = _update(tiny_model_dir, data, ["schedule.micro_batch_tokens=48"], policy=_gpt2(), lr=1.0)
    plain, _ = _update(tiny_model_dir, data, PLAIN, policy=_gpt2(), lr=1.0)
    assert metrics["loss/trained_seq_frac"] == 0.5  # the skip still applies on the fallback path
    assert any(float(a.abs().max()) > 0 for a in plain)  # the reference update moved something
    for a, b in zip(fallback, plain):
        assert _relative_error(a, b) <= FP64_TOL
