"""A policy turn's per-row cap on the HF engine: a row that reaches its own cap is finished there, so
it does not keep the turn's generate call running once every other row is done (the call used to
run on to the largest cap until that row sampled EOS); the kept tokens are the same either way. The
vLLM engine gives each request its own max_tokens (mugrpo/rollout/engines/vllm.py), so no row holds
another there."""
import pytest
import torch

from mugrpo.config import RolloutConfig
from mugrpo.models.loading import load_tokenizer
from mugrpo.rollout.engines import hf
from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.engines.hf import HFEngine


class NeverDone(hf.StoppingCriteria):
    """The behaviour before RowLimits: a capped row is never finished by its cap."""

    def __init__(self, limits, width):
        pass

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run(engine, tok, seed):
    steps = []
    generate = engine.model.generate

    def counting(*args, **kwargs):
        out = generate(*args, **kwargs)
        steps.append(out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    engine.model.generate = counting
    try:
        out = engine.generate([tok("u:1+1?\na:")["input_ids"], tok("u:hello\na:")["input_ids"]],
                              SamplingConfig(n=1, temperature=1.0, max_new_tokens=40, seed=seed),
                              max_new_tokens=[2, 40])
    finally:
        engine.model.generate = generate
    return steps[0], [(c.token_ids, c.finish_reason) for group in out for c in group]


@pytest.mark.parametrize("seed", [0, 11])
def test_a_row_at_its_cap_does_not_hold_the_turn(tiny_model_dir, seed, monkeypatch):
    tok = load_tokenizer(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, tok, RolloutConfig(batch_size=64, dtype="float32"))
    engine.eos = list(range(0, 100, 2))  # half the vocabulary ends a turn: the 40-token row ends early
    steps, rows = run(engine, tok, seed)
    # these seeds: row 0 reaches its cap of 2 without EOS, row 1 ends on EOS within 2 tokens
    assert rows[0][1] == "length" and len(rows[0][0]) == 2 and rows[1][1] == "stop" and len(rows[1][0]) <= 2
    assert steps == 2
    monkeypatch.setattr(hf, "RowLimits", NeverDone)
    old_steps, old_rows = run(engine, tok, seed)
    assert old_rows == rows and old_steps > 2  # the same tokens; before, the call ran on
