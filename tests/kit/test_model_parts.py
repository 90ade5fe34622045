"""The optimizer every phase builds (mugrpo/kit/model_parts.py build_optimizer)."""
import pytest
import torch

from mugrpo.config import load_config
from mugrpo.config.plan import make_plan
from mugrpo.kit.model_parts import build_optimizer

pytestmark = pytest.mark.unit


def _steps(model, optimizer, num_steps=5):
    gen = torch.Generator().manual_seed(1)
    for _ in range(num_steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_cpu_optimizer_steps_one_parameter_at_a_time_with_the_multi_tensor_steps_results(weight_decay):
    # One parameter at a time allocates its step's temporaries for one parameter, not for the whole model;
    # the arithmetic is the same, so the weights and moments after 5 steps are bitwise those of foreach.
    cfg = load_config(overrides=[f"optim.weight_decay={weight_decay}", "optim.lr=1e-2"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 7), torch.nn.LayerNorm(7))
    twin = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 7), torch.nn.LayerNorm(7))
    twin.load_state_dict(model.state_dict())
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer, _ = build_optimizer(model, cfg, make_plan(cfg))
    assert optimizer.param_groups[0]["foreach"] is False
    o = cfg.optim
    reference = torch.optim.AdamW(twin.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, foreach=True)
    ours, theirs = _steps(model, optimizer), _steps(twin, reference)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"])
    assert not any(torch.equal(a, b) for a, b in zip(ours, initial))  # every parameter moved
