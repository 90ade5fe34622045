"""The Python API: build a config in code and train it with one call, from a script or a notebook.

    import mugrpo

    def brevity(prompts, completions, **kwargs):            # TRL's reward signature
        return [-len(c) / 1000 for c in completions]

    result = mugrpo.train(
        {"preset": "mu-grpo", "schedule.total_updates": 8, "rollout.max_new_tokens": 64},
        train_dataset=[{"prompt": "What is 2 + 3?", "answer": "5"}, ...],    # or a datasets.Dataset
        reward_funcs=["correctness", brevity], reward_weights=[1.0, 0.1],
    )
    result.final_model, result.metrics()[-1]

A supervised warm start alone: ``mugrpo.sft({"warmstart.epochs": 2}, data="demos.jsonl", run_dir=...)`` (or
``data=`` a ``datasets.Dataset``, a list of rows, or an earlier run's directory for rejection sampling);
with ``warmstart.data`` set, :func:`train` runs one first, in ``RUN_DIR/warmstart/`` (docs/WARMSTART.md).
``mugrpo.evaluate(model, tasks, ...)`` mirrors ``mugrpo eval`` and returns its report.

The run directory is the one ``mugrpo train`` writes (config.yaml, metrics.jsonl, stages/,
checkpoints/, final_model/). What a config file cannot hold is recorded in config.yaml by name: a
reward function as ``python:module.qualname``, data given as rows as ``task.kind: rows`` with a
fingerprint of the rows in ``task.name``. Such a run resumes from Python, with the same functions and
data: ``mugrpo.train(run_dir=..., resume=True, reward_funcs=..., train_dataset=...)``.

Under ``torchrun`` every process runs the script and calls :func:`train`; give ``run_dir``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from mugrpo.config import Config, ConfigError, from_dict, load_config, set_value, validate
from mugrpo.rollout.rewards import PYTHON_PREFIX, function_label

ConfigLike = Union[Config, dict, str, Path, None]
RewardLike = Union[str, Callable]


@dataclass
class TrainResult:
    run_dir: Path
    final_model: Optional[Path]
    """The exported HF model folder (None with ``train.save_final_model=false``)."""

    def metrics(self, kind: Optional[str] = None) -> list[dict]:
        """The records of ``metrics.jsonl`` (``kind``: ``update``, ``stage``, ``eval``, or ``sft`` for a warm
        start's steps, only)."""
        from mugrpo.run_dir import RunDir

        path = RunDir(self.run_dir).metrics
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if kind is None or r.get("kind") == kind]


def make_config(config: ConfigLike = None, preset: Optional[str] = None) -> Config:
    """A validated Config from a Config, a dict (nested sections and/or dotted keys, as in a YAML
    config file; ``preset`` may be one of its keys), a YAML file's path, or None (the defaults)."""
    if isinstance(config, Config):
        if preset is not None and preset != config.preset:
            raise ConfigError(f"preset={preset!r} and a Config built with preset {config.preset!r}; give one")
        validate(config)
        return config
    if config is None or isinstance(config, dict):
        values = dict(config or {})
        chosen = preset or values.pop("preset", None)
        values.pop("preset", None)
        cfg = load_config(chosen)
        for key, value in values.items():
            set_value(cfg, key, value)
        validate(cfg)
        return cfg
    if isinstance(config, (str, Path)):
        return load_config(preset, config)
    raise ConfigError(f"config must be a mugrpo Config, a dict of keys, a YAML file path or None; got "
                      f"{type(config).__name__}")


def train(config: ConfigLike = None, *, preset: Optional[str] = None,
          reward_funcs: Union[RewardLike, list[RewardLike], None] = None, reward_weights: Optional[list[float]] = None,
          train_dataset: Any = None, eval_dataset: Any = None, run_dir: Union[str, Path, None] = None,
          tools: Optional[list] = None, environment: Any = None, resume: bool = False,
          replay: Union[str, Path, None] = None) -> TrainResult:
    """Train (or resume) a run; returns where it is and its final model.

    - ``config``: see :func:`make_config`; the same keys as ``mugrpo train``.
    - ``reward_funcs``: built-in names (``correctness``, ``math_verify``, ``boxed_format``),
      ``module:function`` paths or functions (``f(prompts, completions, **kwargs) -> list[float]`` as
      in TRL, or ``f(completion, answer, item) -> float``), summed with ``reward_weights`` (default 1
      each); they replace ``task.rewards``.
    - ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset`` or a list of dicts with a ``prompt``
      column (a string or chat messages) or a ``question`` column, and an ``answer`` (or
      ``solution``) column for the correctness reward; or a file path / HF dataset name
      (``task.kind=math``). Without ``eval_dataset`` the last ``task.eval_size`` rows are held out.
    - ``tools``: functions the model may call, as TRL's ``tools=`` (type hints and a docstring with
      ``Args:``), or ``module:function`` paths; sets ``task.tools`` (docs/ENVIRONMENTS.md).
    - ``environment``: a multi-turn environment: a name (``calculator``, ``multi_attempt``,
      ``skyrl_gym``), a ``module:Class`` path, an Environment class or factory, or a TRL
      ``environment_factory``; sets ``task.env`` (its arguments: ``task.env_args``).
    - ``resume=True``: continue the run in ``run_dir`` from its last checkpoint, with the same
      reward functions, tools, environment and data when they were given from Python.
    - ``replay``: the run directory of an earlier run whose saved stages this run trains on instead of
      generating (``mugrpo train --replay``; docs/ALGORITHM.md section 5d). A resumed replay keeps
      replaying the source it recorded.
    """
    from mugrpo.rollout.tasks import build_task
    from mugrpo.pipeline import train as run_training

    if resume:
        if run_dir is None:
            raise ConfigError("resume=True needs run_dir: the run to continue")
        if config is not None or preset is not None:
            raise ConfigError("resume=True takes the run's own config.yaml; drop config/preset")
        cfg = _resumed_config(Path(run_dir), reward_funcs, reward_weights)
        _resumed_environment(cfg, Path(run_dir), tools, environment)
    else:
        cfg = make_config(config, preset)
        if reward_funcs is not None:
            _set_rewards(cfg, reward_funcs, reward_weights)
        elif reward_weights is not None:
            raise ConfigError("reward_weights without reward_funcs; give the functions they weigh")
        if tools is not None:
            cfg.task.tools = list(tools) if isinstance(tools, (list, tuple)) else [tools]
        if environment is not None:
            cfg.task.env = environment
    rows, eval_rows = _data(cfg, train_dataset, eval_dataset, resume)
    validate(cfg)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    task = build_task(cfg.task, rows, eval_rows) if rows is not None else None
    final = run_training(cfg, run_dir, resume=resume, task=task, replay=replay)
    return TrainResult(run_dir, final if cfg.train.save_final_model else None)


def default_run_dir(cfg: Config, name: Optional[str] = None) -> Path:
    """``runs/<name or preset>-<time>``, as ``mugrpo train`` (and ``mugrpo sft``: ``runs/sft-<time>``)
    names a run without ``--run-dir``."""
    return Path(f"runs/{name or cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}")


def sft(config: ConfigLike = None, *, data: Any = None, preset: Optional[str] = None,
        run_dir: Union[str, Path, None] = None, resume: bool = False) -> TrainResult:
    """A supervised warm start alone (``mugrpo sft``; docs/WARMSTART.md): returns the run and its
    ``final_model``, an HF folder an RL run can start from (``model.name``).

    - ``config``: see :func:`make_config`; the ``warmstart.*`` keys set the warm start.
    - ``data``: the demonstrations: a file (``.jsonl``, ``.json``, ``.parquet``), an earlier run's
      directory (rejection sampling, ``warmstart.min_reward``), or rows: a ``datasets.Dataset`` or a
      list of dicts, recorded in config.yaml as ``warmstart.data: "python:N rows, sha256 H"``. Sets
      ``warmstart.data``.
    - ``resume=True``: continue the warm start in ``run_dir`` from its last checkpoint; one trained on
      rows needs the same rows again as ``data``.
    """
    from mugrpo.kit.lifecycle import resume_config
    from mugrpo.pipeline import sft as run_sft
    from mugrpo.warmstart.source import rows_label

    rows = None if data is None or isinstance(data, (str, Path)) else _as_rows(data, "data")
    if resume:
        if run_dir is None:
            raise ConfigError("resume=True needs run_dir: the warm start to continue")
        if config is not None or preset is not None:
            raise ConfigError("resume=True takes the run's own config.yaml; drop config/preset")
        cfg = resume_config(Path(run_dir), [])
        stored = str(cfg.warmstart.data)
        if (rows_label(rows) if rows is not None else None) != (stored if _is_label(stored) else None) or (
                data is not None and rows is None):
            raise ConfigError(f"{run_dir} was warm-started on warmstart.data={stored!r}; resume it with "
                              + ("the same rows as data=" if _is_label(stored) else "no data= (it reads that again)"))
    else:
        cfg = make_config(config, preset)
        if data is not None:
            cfg.warmstart.data = rows_label(rows) if rows is not None else str(data)
            validate(cfg)
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg, "sft")
    return TrainResult(run_dir, run_sft(cfg, run_dir, resume=resume, rows=rows))


EVAL_OPTIONS = {"k": "--k", "n": "--n", "temperature": "--temperature", "top_p": "--top-p",
                "max_new_tokens": "--max-new-tokens", "num_items": "--num-items", "engine": "--engine",
                "seed": "--seed", "config": "--config"}
""":func:`evaluate`'s options and the ``mugrpo eval`` flags they are (``greedy=False``: ``--no-greedy``)."""


def evaluate(model: Union[str, Path], tasks: Union[str, list[str], None] = None, *,
             overrides: Union[dict, list[str], None] = None, out: Union[str, Path, None] = None,
             samples: Union[str, Path, None] = None, **options) -> dict:
    """Evaluate a model or a run, as ``mugrpo eval`` does (docs/EVALUATION.md); returns the report
    (``tasks``: each task's metrics, ``overall``: their mean, ``settings``), also printed as the table.

    - ``model``: an HF folder or hub id, a run directory, or one of its checkpoints.
    - ``tasks``: ``mugrpo eval --task`` specs (default ``train``: the run's own held-out items).
    - ``overrides``: ``{"env.max_turns": 5}`` or ``["env.max_turns=5"]``: ``task.*``, ``env.*``,
      ``rollout.*``, ``model.*`` and ``train.threads``, as the command's ``key=value``.
    - ``out`` / ``samples``: the command's ``--out`` (JSON report) and ``--samples`` (every response;
      with an environment the whole trajectory).
    - ``options``: ``k`` (an int, a list or "1,8"), ``n``, ``greedy`` (False: no greedy response),
      ``temperature``, ``top_p``, ``max_new_tokens``, ``num_items``, ``engine``, ``seed``, ``config``.
    """
    import argparse

    from mugrpo.evaluation import cli as eval_cli

    argv = ["--model", str(model)]
    for spec in [tasks] if isinstance(tasks, str) else (tasks or []):
        argv += ["--task", str(spec)]
    if not options.pop("greedy", True):
        argv.append("--no-greedy")
    for key, value in options.items():
        if key not in EVAL_OPTIONS:
            raise ConfigError(f"mugrpo.evaluate: unknown option {key!r}; accepted: greedy, "
                              f"{', '.join(EVAL_OPTIONS)} (and overrides=, out=, samples=)")
        if value is not None:
            shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            argv += [EVAL_OPTIONS[key], shown]
    for flag, path in (("--out", out), ("--samples", samples)):
        if path is not None:
            argv += [flag, str(path)]
    if isinstance(overrides, dict):
        overrides = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()]
    argv += list(overrides or [])

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # a ConfigError naming the option, not SystemExit
            raise ConfigError(f"mugrpo.evaluate: {message}")

    parser = Parser(prog="mugrpo.evaluate")
    eval_cli.add_arguments(parser)
    return eval_cli.run_eval(parser.parse_args(argv))


def _set_rewards(cfg: Config, funcs, weights) -> None:
    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    if not funcs:
        raise ConfigError("reward_funcs is empty; give at least one reward")
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward_funcs; give one each")
    cfg.task.reward_fn = None
    cfg.task.rewards = [{"fn": f, "weight": w} for f, w in zip(funcs, weights)]


def _resumed_config(run_dir: Path, funcs, weights) -> Config:
    """The run's config, with the Python reward functions it was trained with put back in place."""
    from mugrpo.kit.lifecycle import resume_config

    cfg = resume_config(run_dir, [])
    stored = [spec["fn"] for spec in cfg.task.rewards]
    python = [i for i, fn in enumerate(stored) if isinstance(fn, str) and fn.startswith(PYTHON_PREFIX)]
    if not python:
        if funcs is not None:
            raise ConfigError(f"{run_dir} was trained with the rewards in its config.yaml; drop reward_funcs")
        return cfg
    given = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] if funcs is not None else []
    if len(given) != len(stored) or any(
            function_label(f) != stored[i] if callable(f) else f != stored[i] for i, f in enumerate(given)):
        raise ConfigError(f"{run_dir} was trained with reward_funcs {stored}; pass the same ones, in that order, "
                          f"to resume it (got {[function_label(f) if callable(f) else f for f in given]})")
    if weights is not None and list(weights) != [spec.get("weight", 1.0) for spec in cfg.task.rewards]:
        raise ConfigError("reward_weights differ from the run's; a resumed run keeps its weights (drop them)")
    for i in python:
        cfg.task.rewards[i] = {**cfg.task.rewards[i], "fn": given[i]}
    return cfg


def _resumed_environment(cfg: Config, run_dir: Path, tools, environment) -> None:
    """Put back the Python tools and environment a run was trained with (config.yaml holds their
    ``python:`` labels); anything else given must equal what the run used."""
    def shown(value):
        return function_label(value) if callable(value) else value

    stored_env, given_env = cfg.task.env, environment
    if given_env is not None or _is_label(stored_env):
        if shown(given_env) != stored_env:
            raise ConfigError(f"{run_dir} was trained with environment {stored_env!r}; pass the same one to resume it "
                              f"(got {shown(given_env)!r})" + (" or drop it" if not _is_label(stored_env) else ""))
        cfg.task.env = given_env
    stored_tools = list(cfg.task.tools)
    given_tools = [] if tools is None else list(tools) if isinstance(tools, (list, tuple)) else [tools]
    if tools is not None or any(_is_label(t) for t in stored_tools):
        if [shown(t) for t in given_tools] != stored_tools:
            raise ConfigError(f"{run_dir} was trained with tools {stored_tools}; pass the same ones, in that order, to "
                              f"resume it (got {[shown(t) for t in given_tools]})")
        cfg.task.tools = given_tools


def _is_label(value) -> bool:
    return isinstance(value, str) and value.startswith(PYTHON_PREFIX)


def _data(cfg: Config, train_dataset, eval_dataset, resume: bool) -> tuple[Optional[list], Optional[list]]:
    """Rows given from Python (and ``task.kind=rows`` with their fingerprint), or None for a file/name."""
    if train_dataset is None:
        if eval_dataset is not None:
            raise ConfigError("eval_dataset without train_dataset; give both, or set task.* for the data")
        return None, None
    if isinstance(train_dataset, (str, Path)):
        if eval_dataset is not None:
            raise ConfigError("eval_dataset with a train_dataset file: the held-out rows are the file's last "
                              "task.eval_size rows; pass both as rows to choose them")
        if not resume:
            cfg.task.kind, cfg.task.name = "math", str(train_dataset)
        return None, None
    rows = _as_rows(train_dataset, "train_dataset")
    eval_rows = _as_rows(eval_dataset, "eval_dataset") if eval_dataset is not None else None
    name = "python:" + _fingerprint(rows, eval_rows)
    if resume and (cfg.task.kind != "rows" or cfg.task.name != name):
        raise ConfigError(f"train_dataset/eval_dataset differ from the data the run was trained with "
                          f"(task.name={cfg.task.name!r}, these are {name!r}); a resumed run needs the same data")
    cfg.task.kind, cfg.task.name = "rows", name
    return rows, eval_rows


def _as_rows(data: Any, what: str) -> list[dict]:
    if hasattr(data, "to_list") and callable(data.to_list):  # datasets.Dataset
        return list(data.to_list())
    if isinstance(data, (list, tuple)):
        return list(data)
    raise ConfigError(f"{what} must be a datasets.Dataset, a list of dicts, or a file path / HF dataset name; got "
                      f"{type(data).__name__}")


def _fingerprint(rows: list, eval_rows: Optional[list]) -> str:
    text = json.dumps([rows, eval_rows], sort_keys=True, default=str)
    return f"{len(rows)}-rows-sha256-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def from_trl(dataset: Iterable[dict], answer_column: Optional[str] = None) -> list[dict]:
    """Rows in TRL's or verl's style as mugrpo rows, in one call.

    The prompt: a ``prompt`` column (a string or chat messages) is kept; a ``messages`` column (chat,
    as in TRL's SFT data) becomes the prompt, without a trailing assistant turn (whose text becomes
    the ``completion`` column); else ``question`` or ``problem``. The answer: ``answer_column``, else
    ``answer``, ``solution``, ``ground_truth``, or verl's ``reward_model.ground_truth``, as
    ``answer``. Every other column is kept (reward functions receive them).
    """
    out = []
    for i, row in enumerate(dataset):
        row = dict(row)
        if "prompt" in row:
            prompt = row.pop("prompt")
        elif "messages" in row:
            prompt = list(row.pop("messages"))
            if prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
                row.setdefault("completion", prompt.pop()["content"])
        elif "question" in row or "problem" in row:
            prompt = row.pop("question") if "question" in row else row.pop("problem")
        else:
            raise ConfigError(f"row {i} has no prompt: TRL-style rows have a 'prompt' (or 'messages') column; "
                              f"its columns are {sorted(row)}")
        answer = _answer(row, answer_column, i)
        out.append({"prompt": prompt, **row, **({"answer": answer} if answer is not None else {})})
    return out


def _answer(row: dict, column: Optional[str], i: int) -> Optional[str]:
    if column is not None:
        if column not in row:
            raise ConfigError(f"row {i} has no column {column!r} (answer_column); its columns are {sorted(row)}")
        return None if row[column] is None else str(row[column])
    for key in ("answer", "solution", "ground_truth"):
        if row.get(key) is not None:
            return str(row[key])
    truth = row.get("reward_model")
    if isinstance(truth, dict) and truth.get("ground_truth") is not None:
        return str(truth["ground_truth"])
    return None
