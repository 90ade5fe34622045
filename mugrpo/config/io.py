"""Config I/O: YAML files, ``key=value`` overrides, type coercion, renamed keys, and the dump.

Resolution order: dataclass defaults (:mod:`mugrpo.config.schema`) -> preset
(:mod:`mugrpo.config.presets`) -> YAML file -> ``key=value`` overrides, then
:func:`mugrpo.config.rules.validate`. A YAML file and the command line hold only what differs from
the defaults. Every error names the offending key and what is accepted. No range rule lives here.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from mugrpo.algo.registries import CORRECTIONS
import mugrpo.config.rollout_sections as rollout_sections
import mugrpo.config.schema as schema
import mugrpo.config.warmstart_section as warmstart_section
from mugrpo.config.presets import PRESETS
from mugrpo.config.rules import validate
from mugrpo.config.schema import Config
from mugrpo.errors import ConfigError



def _fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp) -> Any:
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp in (dict, list):
        if isinstance(value, tp):
            return value
    raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")


_VLLM_KEYS = ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager", "kv_cache_gb",
              "sleep_level", "in_process", "max_num_seqs", "cpu_threads_bind")
RENAMED_KEYS = {"eval.k": "eval.num_samples",
                **{f"rollout.vllm_{k}": f"rollout.vllm.{k}" for k in _VLLM_KEYS}}
"""Old key names still accepted, silently (run directories written before a rename hold them in
config.yaml, and a resume must read them as they are): old -> new. The flat ``rollout.vllm_*`` keys
became the ``rollout.vllm`` section."""


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set a dotted ``key`` (e.g. ``loss.veto_delta``) on ``cfg`` with type checking."""
    key = RENAMED_KEYS.get(key, key)
    parts = key.split(".")
    obj = cfg
    for depth, part in enumerate(parts):
        fields = _fields(obj)
        if part not in fields:
            prefix = ".".join(parts[:depth])
            valid = sorted((f"{prefix}.{n}" if prefix else n) for n in fields)
            close = difflib.get_close_matches(".".join(parts[: depth + 1]), valid, n=1)
            hint = _colon_hint(part) or (f" Did you mean {close[0]!r}?" if close else "")
            raise ConfigError(f"unknown config key {key!r}.{hint} Valid keys here: {', '.join(valid)}")
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: is a section; set its fields, e.g. {key}.<field>=...")
                for sub, sub_value in value.items():
                    set_value(cfg, f"{key}.{sub}", sub_value)
                return
            hints = typing.get_type_hints(type(obj))
            for sub in value if isinstance(value, dict) else ():
                if isinstance(sub, str) and value[sub] is None and _colon_hint(sub):
                    raise ConfigError(f"{key}: key {sub!r} has no value.{_colon_hint(sub)}")
            setattr(obj, part, _coerce(key, value, hints[part]))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"{key}: {'.'.join(parts[: depth + 1])} is a value, not a section")


def _colon_hint(key: str) -> str:
    """A hint for ``{a:1}``, which YAML reads as the single key 'a:1' (a flow mapping needs a space after
    the colon); empty for other keys."""
    name, colon, rest = key.partition(":")
    if not colon or not name.strip() or rest.startswith(" "):
        return ""
    return (f" YAML reads {key!r} as one key because there is no space after the colon; "
            f"write {{{name}: {rest}}}.")


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=1e-3"`` -> ``("a.b", 0.001)``; values are read as YAML (``null``, lists, numbers)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. loss.veto_delta=1e-3)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(preset: Optional[str] = None, file: Optional[str | Path] = None,
                overrides: Optional[list[str]] = None) -> Config:
    """Defaults -> preset -> YAML file -> ``key=value`` overrides, then :func:`validate`."""
    file_values = read_config_file(file) if file is not None else {}
    cli_values = [parse_override(o) for o in overrides or []]
    name = preset or file_values.pop("preset", None) or dict(cli_values).get("preset") or Config.preset
    file_values.pop("preset", None)
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = Config(preset=name)
    for key, value in PRESETS[name].items():
        set_value(cfg, key, value)
    for key, value in list(file_values.items()) + [kv for kv in cli_values if kv[0] != "preset"]:
        set_value(cfg, key, value)
    validate(cfg)
    return cfg


def read_config_file(file: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds ({} for an empty file); ConfigError naming the file when it
    is missing, unreadable, not UTF-8, not YAML, or not a mapping."""
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return dict(loaded)


def read_run_config(run_dir: str | Path, what: str, required: bool = True) -> dict[str, Any]:
    """The values of a run directory's ``config.yaml``: the one reader of a run's config (resume,
    ``mugrpo eval --model RUN``, a replay source, the report).

    ``what`` names the run the way the caller's user gave it (e.g. ``"--resume runs/a"``), for the
    messages. A missing or empty file is a :class:`mugrpo.run_dir.RunDirError` (``required=False``:
    {} for a missing one, as the report takes it); a file that is not YAML a ConfigError naming it."""
    from mugrpo.run_dir import RunDir, RunDirError

    path = RunDir(run_dir).config
    if not path.is_file():
        if not required:
            return {}
        raise RunDirError(f"{what}: no config.yaml in {run_dir}, so it is not a mugrpo run directory")
    values = read_config_file(path)
    if not values and required:
        raise RunDirError(f"{what}: {path} is empty; restore it (each checkpoints/ckpt_*/config.yaml holds a copy "
                          "of the run's config) or start a new run")
    return values



def to_dict(cfg: Config) -> dict:
    """The config as plain data; a reward, tool or environment given as a Python object is written
    ``python:module.qualname``, and so is any value of ``task.env_args`` that YAML cannot hold (a
    function, an object: :func:`plain_data`)."""
    from mugrpo.rollout.rewards import function_label

    def label(value):
        return function_label(value) if callable(value) else value

    rewards = [{**spec, "fn": label(spec["fn"])} if isinstance(spec, dict) else spec for spec in cfg.task.rewards]
    task = dataclasses.replace(cfg.task, rewards=rewards, env=label(cfg.task.env),
                               tools=[label(t) for t in cfg.task.tools], env_args=plain_data(cfg.task.env_args))
    return dataclasses.asdict(dataclasses.replace(cfg, task=task))


def plain_data(value: Any) -> Any:
    """``value`` as what a YAML file can hold: mappings, lists (a tuple becomes one), strings, numbers,
    booleans and null are kept; anything else (a function, a class, an object) becomes its
    ``python:module.qualname`` label, as a reward or tool given from Python is recorded. A run that
    read the label back refuses it when its environment is built (:mod:`mugrpo.rollout.envs.build`)."""
    from mugrpo.rollout.rewards import function_label

    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) else str(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):  # also numpy's integers, which YAML's writer refuses
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return function_label(value)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, width=100)


def from_dict(values: dict) -> Config:
    """Rebuild a Config from :func:`to_dict` output (e.g. a run directory's config.yaml)."""
    cfg = Config(preset=values.get("preset", Config.preset))
    for key, value in values.items():
        if key != "preset":
            set_value(cfg, key, value)
    validate(cfg)
    return cfg


def field_docs() -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field, for the config reference (docs/CONFIG.md)."""
    import ast
    import inspect

    docs: dict[tuple[str, str], str] = {}
    for node in (n for module in (rollout_sections, schema, warmstart_section) for n in ast.parse(inspect.getsource(module)).body):
        if isinstance(node, ast.ClassDef):
            body = node.body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[(node.name, a.target.id)] = " ".join(str(b.value.value).split())
    for param in CORRECTIONS.all_params():  # declared with their option, in the registry
        docs[("LossConfig", param.name)] = " ".join(param.doc.split())
    return [row for section in dataclasses.fields(Config) if section.name != "preset"
            for row in _section_docs(getattr(Config(), section.name), section.name, docs)]


def _section_docs(sub, prefix: str, docs: dict) -> list[tuple[str, str, str]]:
    rows = []
    for f in dataclasses.fields(sub):
        value = getattr(sub, f.name)
        if dataclasses.is_dataclass(value):
            rows += _section_docs(value, f"{prefix}.{f.name}", docs)
        else:
            rows.append((f"{prefix}.{f.name}", repr(value), docs.get((type(sub).__name__, f.name), "")))
    return rows
