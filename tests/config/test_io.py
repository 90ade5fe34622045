"""Config I/O (mugrpo.config.io): overrides read as YAML, typed setting of a nested key, renamed keys,
and the unknown key's suggestion."""
import pytest

from mugrpo.config.io import RENAMED_KEYS, parse_override, set_value
from mugrpo.config.schema import Config
from mugrpo.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text, expected", [
    ("schedule.total_updates=16", ("schedule.total_updates", 16)),
    ("optim.lr=1.0e-3", ("optim.lr", 0.001)),
    ("optim.lr=1e-3", ("optim.lr", "1e-3")),  # YAML 1.1 needs a dot for a float: a string (set_value coerces it)
    ("optim.lr=0.5", ("optim.lr", 0.5)),
    ("task.few_shot=[]", ("task.few_shot", [])),
    ("log.loggers=[jsonl, stdout]", ("log.loggers", ["jsonl", "stdout"])),
    ("train.progress=false", ("train.progress", False)),
    ("model.revision=null", ("model.revision", None)),
    ("task.instruction=", ("task.instruction", "")),
    (" loss.veto_scope =suffix", ("loss.veto_scope", "suffix")),  # the key is stripped
    ("task.instruction=a=b", ("task.instruction", "a=b")),  # split at the first '=' only
])
def test_parse_override_reads_the_value_as_yaml(text, expected):
    key, value = parse_override(text)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


def test_parse_override_without_equals_names_the_form():
    with pytest.raises(ConfigError, match=r"override 'optim.lr' is not of the form key=value"):
        parse_override("optim.lr")


def test_set_value_on_a_nested_key_coerces_to_the_field_type():
    cfg = Config()
    set_value(cfg, "optim.lr", "1e-3")  # the string YAML gives for 1e-3 becomes a float
    assert cfg.optim.lr == 0.001 and type(cfg.optim.lr) is float
    set_value(cfg, "optim.lr", 2)  # an int for a float field becomes a float
    assert cfg.optim.lr == 2.0 and type(cfg.optim.lr) is float
    set_value(cfg, "rollout.vllm.kv_cache_gb", 3.5)  # two levels down
    assert cfg.rollout.vllm.kv_cache_gb == 3.5
    set_value(cfg, "schedule.num_stages", None)  # Optional[int] takes null
    assert cfg.schedule.num_stages is None


def test_set_value_refuses_a_wrong_type_naming_the_key_and_the_type():
    cfg = Config()
    with pytest.raises(ConfigError, match=r"schedule.total_updates: got 'many' \(str\); expected int"):
        set_value(cfg, "schedule.total_updates", "many")
    with pytest.raises(ConfigError, match=r"train.progress: got 1 \(int\); expected bool"):
        set_value(cfg, "train.progress", 1)  # no truthy ints for a bool
    with pytest.raises(ConfigError, match=r"schedule.total_updates: got True \(bool\); expected int"):
        set_value(cfg, "schedule.total_updates", True)  # a bool is not an int here


def test_a_section_takes_a_mapping_of_its_fields_only():
    cfg = Config()
    set_value(cfg, "optim", {"lr": 3e-6, "warmup_updates": 2})
    assert (cfg.optim.lr, cfg.optim.warmup_updates) == (3e-6, 2)
    with pytest.raises(ConfigError, match=r"optim: is a section; set its fields, e.g. optim.<field>=..."):
        set_value(cfg, "optim", 5)
    with pytest.raises(ConfigError, match=r"optim.lr.x: optim.lr is a value, not a section"):
        set_value(cfg, "optim.lr.x", 5)


def test_a_renamed_key_sets_the_new_one():
    assert RENAMED_KEYS["eval.k"] == "eval.num_samples"
    assert RENAMED_KEYS["rollout.vllm_kv_cache_gb"] == "rollout.vllm.kv_cache_gb"
    cfg = Config()
    set_value(cfg, "eval.k", 4)
    set_value(cfg, "rollout.vllm_kv_cache_gb", 1.5)
    assert cfg.eval.num_samples == 4 and cfg.rollout.vllm.kv_cache_gb == 1.5


def test_an_unknown_key_gets_the_closest_valid_one_and_the_list():
    with pytest.raises(ConfigError) as info:
        set_value(Config(), "loss.veto_delt", 1e-3)
    msg = str(info.value)
    assert msg.startswith("unknown config key 'loss.veto_delt'. Did you mean 'loss.veto_delta'?")
    assert "Valid keys here: " in msg and "loss.veto_scope" in msg
    with pytest.raises(ConfigError, match=r"unknown config key 'optm.lr'. Did you mean 'optim'\?"):
        set_value(Config(), "optm.lr", 1e-3)
