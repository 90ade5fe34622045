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


# ---------------------------------------------------------------------------------------------
# The config in three parts: schema (sections validate themselves), I/O, presets.


def test_config_does_not_import_the_planner():
    # The dependency goes one way: plan imports the schema; importing the config must not load plan.
    code = "import sys, mugrpo.config; print('mugrpo.config.plan' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_each_section_validates_itself():
    from mugrpo.config import LossConfig, RolloutConfig, VllmConfig

    with pytest.raises(ConfigError, match="loss.veto_delta=2 is out of range"):
        LossConfig(veto_delta=2).validate()
    with pytest.raises(ConfigError, match="rollout.vllm.sleep_level=3 is out of range; accepted: 1 or 2"):
        VllmConfig(sleep_level=3).validate()
    with pytest.raises(ConfigError, match="rollout.vllm.kv_cache_gb"):  # the section checks its subsection
        RolloutConfig(vllm=VllmConfig(kv_cache_gb=0)).validate()
    LossConfig().validate()  # the defaults pass


def test_schedule_rules_that_span_sections_are_checked_by_validate():
    # prompts_per_update (schedule) against prompts_per_stage (rollout): 8 > 4.
    with pytest.raises(ConfigError, match="schedule.prompts_per_update=8 exceeds rollout.prompts_per_stage=4"):
        load_config(overrides=["rollout.prompts_per_stage=4"])
    with pytest.raises(ConfigError, match="total_updates=30 is not a multiple of schedule.num_stages=4"):
        load_config(overrides=["schedule.total_updates=30"])


def test_resume_safe_keys_come_from_field_metadata():
    from mugrpo.config import resume_safe_keys
    from mugrpo.kit.lifecycle import RESUME_SAFE_KEYS

    keys = resume_safe_keys()
    assert RESUME_SAFE_KEYS == keys
    # The list the checkpoint module held before the move, as a set (order follows the schema now).
    assert set(keys) == {"train.progress", "train.threads", "checkpoint.every_updates", "checkpoint.keep_last",
                         "checkpoint.max_bad_updates", "task.reward_timeout_s", "rollout.batch_size",
                         "train.save_stage_text", "train.save_final_model", "parallel.activation_checkpointing",
                         "parallel.cpu_offload", "parallel.reshard_after_forward", "parallel.defer_grad_sync",
                         "parallel.timeout_s", "env.max_workers", "env.max_inflight", "warmstart.checkpoint_every", "eval.", "log.",
                         # the services a remote run generates with may change (e.g. after a crash)
                         "rollout.remote.urls", "rollout.remote.weights_dir", "rollout.remote.timeout_s",
                         "rollout.remote.retries", "rollout.remote.stall_timeout_s", "rollout.remote.api_key",
                         "rollout.remote.max_in_flight"}


def test_resume_refuses_a_vllm_section_change():
    from mugrpo.config import to_dict
    from mugrpo.run_dir import RunDirError
    from mugrpo.kit.lifecycle import check_resume_compatible

    saved = to_dict(load_config())
    changed = to_dict(load_config(overrides=["rollout.vllm.max_num_seqs=8"]))
    with pytest.raises(RunDirError, match="rollout.vllm.max_num_seqs: None -> 8"):
        check_resume_compatible(saved, changed)
    check_resume_compatible(saved, to_dict(load_config(overrides=["eval.num_items=3", "train.progress=false"])))


def test_old_flat_vllm_keys_still_load():
    # Run directories written before rollout.vllm became a section hold rollout: {vllm_kv_cache_gb: ...}.
    saved = yaml.safe_load(dump_yaml(load_config()))
    saved["rollout"].pop("vllm")
    saved["rollout"].update(vllm_kv_cache_gb=0.5, vllm_in_process=False, vllm_cpu_threads_bind="0-1")
    cfg = from_dict(saved)
    assert (cfg.rollout.vllm.kv_cache_gb, cfg.rollout.vllm.in_process, cfg.rollout.vllm.cpu_threads_bind) == \
        (0.5, False, "0-1")
    assert load_config(overrides=["rollout.vllm_sleep_level=2"]).rollout.vllm.sleep_level == 2
    assert load_config(overrides=["rollout.vllm.sleep_level=2"]).rollout.vllm.sleep_level == 2
    with pytest.raises(ConfigError, match="rollout.vllm.sleep_level=5 is out of range"):
        load_config(overrides=["rollout.vllm_sleep_level=5"])


def test_empty_model_name_is_refused_naming_the_key(capsys):
    assert main(["plan", "model.name="]) == 2
    assert "model.name is empty" in capsys.readouterr().err


def test_warmup_longer_than_the_run_warns():
    # 40 warmup updates in a 32-update run: the learning rate never reaches optim.lr.
    with pytest.warns(UserWarning, match="optim.warmup_updates=40 exceeds schedule.total_updates=32"):
        load_config(overrides=["optim.warmup_updates=40"])
