import subprocess
import sys

import pytest
import yaml

from mugrpo.cli import main
from mugrpo.config import PRESETS, ConfigError, dump_yaml, from_dict, load_config


def test_presets_match_algorithm_table():
    g, m = load_config("grpo"), load_config("mu-grpo")
    assert (g.loss.clip_eps_low, g.loss.clip_eps_high, g.loss.veto_scope, g.schedule.updates_per_stage) == \
        (0.2, 0.2, "none", 4)
    assert (m.loss.clip_eps_low, m.loss.clip_eps_high, m.loss.veto_scope, m.schedule.num_stages) == \
        (1.0, 4.0, "suffix", 4)
    assert load_config("grpo-stale").loss.clip_eps_high == 0.2
    assert load_config("grpo-stale-relaxed").loss.veto_scope == "none"
    assert load_config("m2po").loss.clip_mode == "m2po"
    assert set(PRESETS) == {"grpo", "grpo-stale", "grpo-stale-relaxed", "m2po", "mu-grpo"}


def test_override_file_and_cli_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("loss:\n  veto_delta: 1e-3\noptim: {lr: 2.0e-6}\ntask:\n  params: {min_terms: 3, max_terms: 3}\n")
    cfg = load_config("mu-grpo", f, ["optim.lr=5e-6"])
    assert cfg.loss.veto_delta == 1e-3  # YAML reads "1e-3" as a string; it is coerced to float
    assert cfg.optim.lr == 5e-6  # CLI beats file
    assert cfg.task.params == {"min_terms": 3, "max_terms": 3}


def test_resolved_config_round_trips():
    cfg = load_config("m2po", overrides=["loss.m2po_budget=0.02", "rollout.top_k=20"])
    again = from_dict(yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("args,needle", [
    (["loss.veto_dleta=1e-3"], "Did you mean 'loss.veto_delta'"),
    (["schedule.total_updates=abc"], "schedule.total_updates"),
    (["loss.veto_scope=prefix"], "loss.veto_scope"),
    (["--preset", "ppo"], "unknown preset 'ppo'"),
    (["loss.veto_delta=2"], "loss.veto_delta"),
    (["rollout.group_size=1"], "rollout.group_size"),
    (["nonsense"], "key=value"),
    (["task.reward_timeout_s=.inf"], "task.reward_timeout_s=inf is out of range; accepted: a finite number"),
    (["optim.beta1=1.5"], "optim.beta1=1.5 is out of range; accepted: in [0, 1)"),
    (["optim.beta2=1"], "optim.beta2=1.0 is out of range"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 is out of range; accepted: a finite number >= 0"),
    (["optim.eps=-1e-8"], "optim.eps=-1e-08 is out of range; accepted: a finite number > 0"),
    (["optim.eps=0"], "optim.eps=0.0 is out of range"),
    (["rollout.temperature=.inf"], "rollout.temperature=inf is out of range; accepted: a finite number > 0"),
    (["eval.temperature=.inf"], "eval.temperature=inf is out of range; accepted: a finite number > 0"),
    (["task.params={min_terms:3}"], "YAML reads 'min_terms:3' as one key because there is no space after the "
                                    "colon; write {min_terms: 3}"),
    (["loss={clip_mode:m2po}"], "no space after the colon; write {clip_mode: m2po}"),
])
def test_bad_config_exits_nonzero_naming_the_key(args, needle, capsys):
    assert main(["plan", *args]) == 2
    assert needle in capsys.readouterr().err


def test_cli_entry_point_exit_code():
    r = subprocess.run([sys.executable, "-m", "mugrpo", "train", "optim.lrr=1"], capture_output=True, text=True)
    assert r.returncode == 2 and "optim.lr" in r.stderr and "Traceback" not in r.stderr


def test_type_errors_are_config_errors():
    with pytest.raises(ConfigError, match="expected bool"):
        load_config(overrides=["train.deterministic=maybe"])
    with pytest.raises(ConfigError, match="is a section"):
        load_config(overrides=["loss=3"])


def test_config_file_that_is_not_utf8_is_named(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_bytes("optim:\n  lr: 1e-5  # \u00b5 in Latin-1\n".encode("latin-1"))
    assert main(["plan", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"config file {str(f)!r} is not UTF-8 text" in err and len(err.strip().splitlines()) == 1


def test_flow_mapping_with_spaces_is_still_accepted():
    assert load_config(overrides=["task.params={min_terms: 3}"]).task.params == {"min_terms": 3}
