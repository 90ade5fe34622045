"""The eval.* and log.* config sections: defaults and validation messages that name the key."""

import pytest

from mugrpo.config import ConfigError, field_docs, load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("override, message", [
    ("eval.num_samples=-1", "eval.num_samples=-1 is out of range"),
    ("eval.every_updates=-2", "eval.every_updates"),
    ("eval.temperature=0", "eval.temperature"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("eval.num_item=3", "Did you mean 'eval.num_items'"),
    ("log.wandb_mode=cloud", "log.wandb_mode"),
])
def test_bad_eval_and_log_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_nothing_to_generate_is_rejected_unless_evaluation_is_off():
    with pytest.raises(ConfigError, match="eval.greedy=false and eval.num_samples=0"):
        load_config(overrides=["eval.greedy=false"])
    cfg = load_config(overrides=["eval.greedy=false", "eval.num_items=0"])
    assert cfg.eval.num_items == 0


def test_every_eval_and_log_field_is_documented():
    undocumented = [key for key, _, doc in field_docs() if key.startswith(("eval.", "log.")) and not doc]
    assert undocumented == []


def test_the_old_name_eval_k_still_loads():
    # Run directories written before the rename hold eval: {k: ...} in config.yaml; resume must read them.
    from mugrpo.config import from_dict, to_dict

    saved = to_dict(load_config())
    saved["eval"].pop("num_samples")
    saved["eval"]["k"] = 3
    assert from_dict(saved).eval.num_samples == 3
    assert load_config(overrides=["eval.k=2"]).eval.num_samples == 2


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0"], "eval.temperature=0.0 is out of range"),
    (["--top-p", "1.5"], "rollout.top_p=1.5 is out of range"),
    (["--no-greedy", "--k", "0"], "eval.greedy=false and eval.num_samples=0"),
    (["--max-new-tokens", "-3"], "eval.max_new_tokens=-3 is out of range"),
    (["--n", "-1", "--k", "0"], "eval.num_samples=-1 is out of range"),
])
def test_mugrpo_eval_settings_go_through_the_config_validation(flags, message, tmp_path, capsys):
    # A folder with a config.json is taken as a model; the settings are checked before it is loaded.
    from mugrpo.cli import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["eval", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "--temperature eval.temperature" in err
