"""One optimizer step as RL and the warm start both take it (mugrpo.kit.step): accumulation with filler
passes, the zero gradient of a rank with nothing to compute, and the skipped step's numbering."""
import pytest
import torch

from mugrpo.kit.checkpoint import RunState
from mugrpo.kit.distributed import World
from mugrpo.kit.step import accumulate, check_some_steps_applied, step_optimizer
from mugrpo.kit.model_parts import TrainingError

pytestmark = pytest.mark.unit


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1, bias=False)


def test_filler_passes_add_nothing_and_their_outputs_are_dropped():
    model = _linear()
    x1, x2 = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    outs = accumulate(model, [x1, x2, x1], 2, World(), lambda x: (model(x).sum(), float(x.sum())))
    assert outs == [3.0, 2.0]  # the filler (a repeat of x1) gives no output ...
    # ... and no gradient: d/dw of w.x1 + w.x2 = x1 + x2 = [4, 1]
    assert model.weight.grad.tolist() == [[4.0, 1.0]]


def test_a_rank_with_nothing_to_compute_gets_a_zero_gradient():
    model = _linear()
    assert accumulate(model, [], 0, World(), lambda x: (model(x).sum(), None)) == []
    assert model.weight.grad.tolist() == [[0.0, 0.0]]


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_a_skipped_step_is_numbered_as_its_metrics_record(capsys):
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 2)).sum().backward()
    state = RunState(update=2)  # two steps done: this one is logged as update 3
    out = step_optimizer(model, optimizer, scheduler, state, 1.0, 5, float("nan"), what="warm-start step")
    assert out["optim/skipped"] == 1.0 and state.num_skipped_updates == 1
    assert "warm-start step 3 skipped" in capsys.readouterr().out


def test_a_phase_whose_every_step_was_skipped_is_an_error():
    check_some_steps_applied(RunState(update=3, num_skipped_updates=2), "updates", "fix it")
    with pytest.raises(TrainingError, match="all 3 updates .* no model was written. fix it"):
        check_some_steps_applied(RunState(update=3, num_skipped_updates=3), "updates", "fix it")
