"""The registries of the extension axes (mugrpo.registry): lazy loading, clear errors, user entries,
each registry's names equal to what the config accepts, and the name lists importable without torch."""
import subprocess
import sys

import pytest
import torch

from mugrpo import config
from mugrpo.algo import registries
from mugrpo.algo.aggregation import SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN
from mugrpo.algo.losses import LossInputs, LossSettings, policy_loss
from mugrpo.config import ConfigError, LossConfig, TaskConfig, load_config
from mugrpo.registry import Registry, RegistryError
from mugrpo.rollout import TASK_KINDS
from mugrpo.rollout.tasks import Item, build_task

pytestmark = pytest.mark.unit


def test_entries_load_lazily_and_unknown_names_are_listed():
    sys.modules.pop("ones_reward", None)
    reg = Registry("test.kind", {"ones": "ones_reward:reward"})
    assert reg.names() == ("ones",) and "ones" in reg
    assert "ones_reward" not in sys.modules  # listing names imports nothing
    assert reg.get("ones")("11ab", "", {}) == 0.5  # 2 of 4 characters are "1"
    assert "ones_reward" in sys.modules
    with pytest.raises(RegistryError, match=r"unknown test.kind 'twos'; choose one of ones"):
        reg.get("twos")
    with pytest.raises(ValueError):  # RegistryError is a ValueError, as the old if/elif errors were
        reg.get("twos")


def test_register_refuses_a_silent_override_and_bad_targets():
    reg = Registry("test.kind", {"a": "json:dumps"})
    with pytest.raises(ValueError, match="'a' is already registered; pass replace=True"):
        reg.register("a", len)
    reg.register("a", len, replace=True)
    assert reg.get("a") is len
    with pytest.raises(ValueError, match="must be 'module:attr'"):
        reg.register("b", "json.dumps")
    reg.register("b", "json:dumps")
    assert reg.names() == ("a", "b")


def test_the_config_accepts_exactly_the_registered_names(monkeypatch):
    # The config's accepted values ARE the registries' names: every registered name loads, an unknown
    # one is refused naming the key and the names, and a name a user registers is accepted.
    for key, reg in (("loss.clip_mode", registries.SURROGATES), ("loss.ratio_level", registries.RATIO_MODES),
                     ("loss.aggregation", registries.AGGREGATORS), ("task.kind", TASK_KINDS)):
        for name in reg.names():
            if name != "rows":  # task.kind=rows is set by mugrpo.train with its rows, not from a config
                load_config(overrides=[f"{key}={name}"])
        with pytest.raises(ConfigError, match=f"{key}='nope' is not a known option; accepted: " + ", ".join(reg.names())):
            load_config(overrides=[f"{key}=nope"])
        for name in reg.names():
            assert callable(reg.get(name)) or hasattr(reg.get(name), "reduce"), (reg, name)
    monkeypatch.setitem(registries.SURROGATES._entries, "mine", "mugrpo.algo.losses:ppo_surrogate")
    assert load_config(overrides=["loss.clip_mode=mine"]).loss.clip_mode == "mine"
    assert config.CLIP_MODES == registries.CLIP_MODES and {"ppo", "m2po"} <= set(config.CLIP_MODES)
    assert config.VETO_SCOPES == registries.VETO_SCOPES


def test_registry_names_import_without_torch():
    code = ("import sys; import mugrpo.algo.registries, mugrpo.rollout, mugrpo.registry; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_each_aggregation_counts_its_own_normaliser():
    # Responses of 3, 0 and 2 tokens. token-mean counts tokens: 3 + 0 + 2 = 5. seq-mean counts
    # sequences: all 3 before the veto; after it only those with a kept token: 2.
    n = torch.tensor([3, 0, 2])
    assert float(TOKEN_MEAN.count(n, post_veto=False)) == 5.0
    assert float(TOKEN_MEAN.count(n, post_veto=True)) == 5.0
    assert float(SEQ_MEAN_TOKEN_MEAN.count(n, post_veto=False)) == 3.0
    assert float(SEQ_MEAN_TOKEN_MEAN.count(n, post_veto=True)) == 2.0


def test_a_user_surrogate_is_used_by_the_loss(monkeypatch):
    # An unclipped surrogate l = -rho * A: rho = e^{ln 2} = 2 with A = 1 gives -2 per token; two tokens
    # summed over a token-mean denominator of 2 give a loss of -2 (PPO's clip at 1.2 would give -1.2).
    def unclipped(log_ratio, advantages, mask, settings):
        loss = -torch.exp(log_ratio) * advantages[:, None]
        none = torch.zeros_like(mask)
        return loss, none, none, {}

    monkeypatch.setitem(registries.SURROGATES._entries, "unclipped", unclipped)
    settings = LossSettings.from_config(LossConfig(clip_mode="unclipped", veto_scope="none"), 2)
    logprobs = torch.log(torch.tensor([[0.5, 0.5]]))
    behavior = torch.log(torch.tensor([[0.25, 0.25]]))
    loss, _ = policy_loss(LossInputs(logprobs, behavior, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), 2.0), settings)
    assert loss.item() == pytest.approx(-2.0)


def test_a_user_task_kind_is_built(monkeypatch):
    def source(task_cfg):
        items = [Item(f"q{i}", str(i)) for i in range(4)]
        return "mine", items, [], lambda completion, answer, item: 1.0

    monkeypatch.setitem(TASK_KINDS._entries, "mine", source)
    task = build_task(TaskConfig(kind="mine", eval_size=0))
    assert task.name == "mine" and [it.prompt for it in task.items] == ["q0", "q1", "q2", "q3"]
