"""Where a warm start's examples come from (``warmstart.data``), read and checked before any model loads.

- a file of demonstrations (``.jsonl``, ``.json``, ``.parquet``: :func:`mugrpo.warmstart.data.load_demonstrations`);
- rows given from Python (a ``datasets.Dataset`` or a list of dicts, ``mugrpo.sft(data=...)``): the
  config records them as ``python:N rows, sha256 H`` (:func:`rows_label`), and the rows travel beside it;
- the run directory of an earlier run (``config.yaml`` and ``stages/``): rejection-sampling
  fine-tuning on its own trajectories with reward >= ``warmstart.min_reward``
  (:func:`mugrpo.warmstart.demos.select_from_run`). Those are token ids already, sampled by that
  run's model: this run's ``model.name`` must be that model (the source's ``model.name``, the
  model its warm start made, or its final model), else a ConfigError naming the key.

:func:`load_source` raises at start (the CLI exits 2) for a bad file, a run of another model, or an
empty selection; :meth:`Source.examples` makes the examples token-level with the model's tokenizer
and holds them to the length rule; :func:`plan_rows` is what ``mugrpo plan`` prints. This module
knows nothing about optimisers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mugrpo.config import Config, ConfigError, read_run_config
from mugrpo.rollout.envs.build import resolve_tools
from mugrpo.rollout.rewards import PYTHON_PREFIX
from mugrpo.run_dir import RunDir
from mugrpo.warmstart.data import Demonstration, DemonstrationError, load_demonstrations
from mugrpo.warmstart.demos import select_from_run
from mugrpo.warmstart.loss import num_steps
from mugrpo.warmstart.render import Example, hold_to_length, render_demonstrations

__all__ = ["Source", "load_source", "rows_label", "is_run_dir", "max_length_for", "plan_rows"]


@dataclass
class Source:
    """The warm start's data before tokenization: demonstrations, or a run's selected trajectories."""

    label: str
    """``warmstart.data`` as the config records it."""
    demos: Optional[list[Demonstration]] = None
    trajectories: Optional[list[Example]] = None
    """A run's kept trajectories (token-level already), with ``selection`` its counts."""
    selection: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.demos) if self.demos is not None else len(self.trajectories or [])

    def examples(self, tokenizer, max_length: int, on_row=None) -> tuple[list[Example], dict]:
        """The examples held to ``max_length`` tokens, and the length rule's counts (with a run's
        selection counts beside them). ``on_row()``: after each demonstration is rendered."""
        if self.demos is not None:
            return render_demonstrations(tokenizer, self.demos, max_length, on_row)
        examples, counts = hold_to_length(self.trajectories or [], max_length)
        return examples, {**counts, **{k: v for k, v in self.selection.items() if k != "reward_max"}}

    def describe(self) -> str:
        """One line on where the data came from (the selection's counts for a run)."""
        if self.trajectories is None:
            return f"{len(self)} demonstrations from {self.label}"
        c = self.selection
        return (f"kept {c['num_kept']} of {c['num_total']} trajectories from {c['num_stages']} complete stage(s) of "
                f"{self.label} (reward >= warmstart.min_reward, finished; {c['num_unfinished']} rewarded enough but "
                "cut at the token budget left out)")


def rows_label(rows: list) -> str:
    """How ``warmstart.data`` records rows given from Python: their number and a fingerprint."""
    text = json.dumps(rows, sort_keys=True, default=str)
    return f"{PYTHON_PREFIX}{len(rows)} rows, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and RunDir(path).config.is_file()


def load_source(cfg: Config, rows: Optional[list] = None) -> Source:
    """``warmstart.data``'s examples-to-be (``rows``: the rows its ``python:`` label stands for);
    DemonstrationError or ConfigError (the CLI exits 2) when they cannot be used."""
    ws = cfg.warmstart
    if ws.data is None:
        raise ConfigError("warmstart.data is not set: give the demonstrations, e.g. warmstart.data=demos.jsonl "
                          "(.jsonl, .json or .parquet, or an earlier run's directory; docs/WARMSTART.md)")
    if rows is None and str(ws.data).startswith(PYTHON_PREFIX):
        raise ConfigError(f"warmstart.data={ws.data!r} stands for rows given from Python; pass them again "
                          "(mugrpo.sft(data=rows, ...)), or give a file or a run directory")
    path = Path(str(ws.data)).expanduser()
    if rows is None and path.is_dir():
        return _from_run(cfg, path)
    try:
        return Source(ws.data, demos=load_demonstrations(rows if rows is not None else path,
                                                         tools=resolve_tools(cfg.task.tools), task_cfg=cfg.task,
                                                         split_calls=ws.split_calls))
    except (DemonstrationError, ConfigError):
        raise
    except (ValueError, OSError) as exc:  # e.g. a .json or .parquet file that does not parse
        raise DemonstrationError(f"warmstart.data={ws.data}: cannot be read "
                                 f"({' '.join(str(exc).split()) or type(exc).__name__})") from exc


def _from_run(cfg: Config, run: Path) -> Source:
    """Rejection sampling: the run's finished trajectories with reward >= ``warmstart.min_reward``."""
    if not is_run_dir(run):
        raise DemonstrationError(f"warmstart.data={run} is a folder without config.yaml: give a demonstrations file, "
                                 "or the run directory of an earlier mugrpo run (config.yaml and stages/)")
    _check_same_model(cfg, run, read_run_config(run, f"warmstart.data={run}"))
    try:
        trajectories, counts = select_from_run(run, cfg.warmstart.min_reward)
    except ValueError as exc:  # a damaged shards.json
        raise DemonstrationError(f"warmstart.data={run}: {exc}") from exc
    if not counts["num_stages"]:
        raise DemonstrationError(f"warmstart.data={run} holds no complete stage (stages/stage_KKK/ with shards.json): "
                                 "there are no trajectories to select from")
    if not counts["num_total"]:
        raise DemonstrationError(f"warmstart.data={run} holds no trajectory: its {counts['num_stages']} complete "
                                 "stage(s) list no shards (shards.json), so there is nothing to select from; give "
                                 "a run whose stages hold trajectories")
    if not trajectories:
        best = "none" if counts["reward_max"] is None else f"{counts['reward_max']:g}"
        raise DemonstrationError(
            f"no trajectory of warmstart.data={run} passes warmstart.min_reward={cfg.warmstart.min_reward:g}: "
            f"{counts['num_total']} read from {counts['num_stages']} stage(s), the best reward {best}, "
            f"{counts['num_unfinished']} rewarded enough but cut at the token budget; lower warmstart.min_reward")
    return Source(str(cfg.warmstart.data), trajectories=trajectories, selection=counts)


def _check_same_model(cfg: Config, run: Path, values: dict) -> None:
    """The trajectories are the source model's ids: this run must train that model (its tokenizer)."""
    theirs = str((values.get("model") or {}).get("name"))
    accepted = [theirs, str(run / "final_model")]
    if (values.get("warmstart") or {}).get("data") is not None:
        accepted.append(str(RunDir(RunDir(run).warmstart).final_model))
    mine = Path(cfg.model.name).expanduser()
    if any(cfg.model.name == a or (mine.exists() and Path(a).expanduser().exists()
                                   and mine.resolve() == Path(a).expanduser().resolve()) for a in accepted):
        return
    raise ConfigError(f"model.name={cfg.model.name!r}, but the trajectories in warmstart.data={run} were sampled "
                      f"from model.name={theirs!r}: rejection sampling fine-tunes the model that sampled them (their "
                      f"token ids are its tokenizer's). Set model.name={theirs!r} (or {run / 'final_model'})")


def max_length_for(cfg: Config, model_path: str) -> int:
    """``warmstart.max_length``, else the model's context, else the RL budget (prompt + new tokens)."""
    from mugrpo.models.loading import model_context

    return cfg.warmstart.max_length or model_context(model_path, cfg.model.trust_remote_code) or (
        cfg.task.max_prompt_tokens + cfg.rollout.max_new_tokens)


def plan_rows(cfg: Config) -> list[tuple[str, Any]]:
    """``mugrpo plan``'s warm-start rows (none without ``warmstart.data``): the source, its size, the
    length rule's counts and the steps (with the model's tokenizer; without it, an upper bound)."""
    ws = cfg.warmstart
    if ws.data is None:
        return []
    source = load_source(cfg)
    rows: list[tuple[str, Any]] = [("warm start data", source.describe())]
    try:
        from mugrpo.models.loading import load_tokenizer, resolve_model_path

        path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
        max_length = max_length_for(cfg, path)
        examples, counts = source.examples(load_tokenizer(path, cfg.model.trust_remote_code), max_length)
    except DemonstrationError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plan still helps without the tokenizer (e.g. offline)
        num, steps = len(source), num_steps(len(source), ws.batch_size, ws.epochs, ws.steps)
        rows += [("warm start tokens", f"unknown: the tokenizer of {cfg.model.name} did not load "
                                       f"({type(exc).__name__})"),
                 ("warm start steps", f"{steps}{'' if ws.steps else f' at most ({num} examples)'}")]
    else:
        rows += [("warm start tokens", f"{counts['num_loss_tokens']} trained a pass; {counts['num_truncated']} cut "
                                       f"to max_length={max_length}, {counts['num_dropped']} dropped"),
                 ("warm start steps", num_steps(len(examples), ws.batch_size, ws.epochs, ws.steps) if examples
                  else "none: every example dropped (raise warmstart.max_length)")]
    epochs = "" if ws.steps else f", {ws.epochs} epoch(s)"
    rows.append(("warm start optimizer", f"lr={ws.lr:g} (schedule {cfg.optim.lr_schedule}, no warmup), "
                                         f"batch_size={ws.batch_size}{epochs}"))
    return rows
