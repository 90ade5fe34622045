"""The warmstart config section (mugrpo.config.warmstart_section): a bad value names its key."""
import pytest

from mugrpo.config.warmstart_section import WarmstartConfig
from mugrpo.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs, needle", [
    ({"lr": 0.0}, "warmstart.lr=0.0 is out of range; accepted: a finite number > 0"),
    ({"lr": -1e-5}, "warmstart.lr=-1e-05 is out of range"),
    ({"lr": float("inf")}, "warmstart.lr=inf is out of range"),
    ({"epochs": 0}, "warmstart.epochs=0 is out of range; accepted: an integer >= 1"),
    ({"steps": 0}, "warmstart.steps=0 is out of range; accepted: an integer >= 1 or null"),
    ({"batch_size": 0}, "warmstart.batch_size=0 is out of range"),
    ({"max_length": 1}, "warmstart.max_length=1 is out of range; accepted: an integer >= 2"),
    ({"checkpoint_every": -1}, "warmstart.checkpoint_every=-1 is out of range"),
    ({"data": "  "}, "warmstart.data='  ' is out of range"),
    ({"min_reward": float("nan")}, "warmstart.min_reward=nan is out of range; accepted: a finite number"),
    ({"min_reward": True}, "warmstart.min_reward=True is out of range"),
])
def test_a_bad_value_names_its_key(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        WarmstartConfig(**kwargs).validate()
    assert needle in str(info.value)


def test_the_defaults_and_edge_values_pass():
    WarmstartConfig().validate()
    # the smallest accepted values: 1 epoch, 1 step, batch 1, 2 tokens, checkpoint only at the end
    WarmstartConfig(data="demos.jsonl", steps=1, batch_size=1, max_length=2, checkpoint_every=0,
                    min_reward=-3).validate()
