"""Evaluation sets: ``--task`` spec strings -> a :class:`mugrpo.rollout.tasks.Task` plus the items to evaluate.

Spec syntax (``mugrpo eval --task SPEC``, repeatable or comma-separated):

=================================  ==============================================================
``train``                          the held-out split (``Task.eval_items``) of the configured
                                   task: a run's own task when ``--model`` is a run directory
``math500`` ``aime24`` ``aime25``  public benchmarks by name, loaded from the Hugging Face hub
``amc23``                          (see :data:`BENCHMARKS` for the dataset, split and columns)
``rg:GENERATOR``                   a reasoning-gym generator's held-out items (``seed + 1``)
``hf:DATASET[@SUBSET][:SPLIT]``    any HF dataset; question/answer columns are detected
``PATH.jsonl|.json|.parquet|.csv`` a local file; question/answer columns are detected
``NAME=SOURCE``                    SOURCE under the display name NAME; ``math500=local.parquet``
                                   uses a local copy with the benchmark's columns (no network)
=================================  ==============================================================

Everything else (prompt format, scorer, timeouts) comes from the :class:`~mugrpo.config.TaskConfig`
the caller passes, so an evaluation renders prompts exactly like training does, and scoring is
:meth:`mugrpo.rollout.tasks.Task.score_all` (math-verify or the generator's checker, or ``task.reward_fn``).

This module knows nothing about models, engines or metrics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mugrpo.rollout.tasks import _FILE_FORMATS, Item, Task, TaskError, build_task, eval_task_config, load_rows


@dataclass(frozen=True)
class Benchmark:
    dataset: str
    split: str
    question_key: str
    answer_key: str
    subset: Optional[str] = None
    about: str = ""


# Column names and splits of the public layouts (dataset cards, checked 2026-11). Mirrors with
# other column names work through ``hf:NAME`` (columns detected), e.g. hf:Maxwell-Jia/AIME_2024
# (Problem/Answer), hf:opencompass/AIME2025@AIME2025-I:test (question/answer),
# hf:AI-MO/aimo-validation-amc (problem/answer; AMC 2022 and 2023, 83 problems).
BENCHMARKS: dict[str, Benchmark] = {
    "math500": Benchmark("HuggingFaceH4/MATH-500", "test", "problem", "answer",
                         about="MATH-500: 500 problems of the MATH test set (Lightman et al. 2023)"),
    "aime24": Benchmark("HuggingFaceH4/aime_2024", "train", "problem", "answer",
                        about="AIME 2024 I and II: 30 problems, integer answers"),
    "aime25": Benchmark("yentinglin/aime_2025", "train", "problem", "answer",
                        about="AIME 2025 I and II: 30 problems, integer answers"),
    "amc23": Benchmark("zwhe99/amc23", "test", "question", "answer",
                       about="AMC 2023: 40 problems, numeric answers"),
}

QUESTION_KEYS = ("question", "problem", "Problem", "Question", "prompt")
ANSWER_KEYS = ("answer", "Answer", "final_answer", "expected_answer")


@dataclass
class EvalSet:
    """One evaluation task: its display name, the Task (scorer), the items and the prompt config."""

    name: str
    task: Task
    items: list[Item]
    task_cfg: object
    """The TaskConfig used to render prompts (instruction, few-shot, system prompt)."""


def split_specs(specs: list[str]) -> list[str]:
    """``["math500,aime24", "rg:chain_sum"]`` -> ``["math500", "aime24", "rg:chain_sum"]``."""
    return [s.strip() for spec in specs for s in spec.split(",") if s.strip()]


def resolve(spec: str, base, num_items: Optional[int] = None) -> EvalSet:
    """Build the :class:`EvalSet` a spec names; ``base`` is the TaskConfig for prompts and scoring.

    ``num_items`` keeps the first N items (in the dataset's own order). Raises TaskError for a
    spec that is not understood, a missing file, or a dataset without usable columns.
    """
    name, source = spec.split("=", 1) if "=" in spec else (spec, spec)
    name, source = name.strip(), source.strip()
    base = eval_task_config(base)
    if not source:
        raise TaskError(f"--task {spec!r}: empty source after '='")
    if source == "train":
        cfg = base if base.kind != "reasoning_gym" else dataclasses.replace(base, size=1)
        task = build_task(cfg)
        if not task.eval_items:
            raise TaskError(f"--task train: task {base.name!r} has no held-out items; raise task.eval_size")
        return EvalSet(name, task, _first(task.eval_items, num_items), cfg)
    if source.startswith("rg:"):
        generator = source[3:]
        same = base.kind == "reasoning_gym" and base.name == generator
        cfg = dataclasses.replace(base, kind="reasoning_gym", name=generator, size=1,
                                  params=dict(base.params) if same else {},
                                  eval_size=num_items or base.eval_size)
        task = build_task(cfg)
        return EvalSet(name, task, _first(task.eval_items, num_items), cfg)
    bench = BENCHMARKS.get(name)
    keys = (bench.question_key, bench.answer_key) if bench else None
    if bench and source == name:
        return _math_set(name, base, bench.dataset, bench.split, bench.subset, num_items, keys)
    if source.startswith("hf:"):
        dataset, subset, split = _parse_hf(source[3:], spec)
        return _math_set(name, base, dataset, split, subset, num_items, keys)
    if Path(source).suffix.lower() in _FILE_FORMATS:
        return _math_set(name, base, _local_file(spec, source), "train", None, num_items, keys)
    raise TaskError(f"--task {spec!r} is not understood. Use one of: train, {', '.join(BENCHMARKS)}, "
                    "rg:GENERATOR, hf:DATASET[@SUBSET][:SPLIT], a .jsonl/.json/.parquet/.csv file, "
                    "or NAME=SOURCE")


def _first(items: list[Item], n: Optional[int]) -> list[Item]:
    return items[:n] if n else list(items)


def _local_file(spec: str, source: str) -> str:
    path = Path(source).expanduser()
    if not path.is_file():
        raise TaskError(f"--task {spec!r}: file {source!r} does not exist")
    return str(path)


def _parse_hf(text: str, spec: str) -> tuple[str, Optional[str], str]:
    """``owner/name[@subset][:split]`` -> (dataset, subset, split); split defaults to ``test``."""
    dataset, _, split = text.partition(":")
    dataset, _, subset = dataset.partition("@")
    if not dataset:
        raise TaskError(f"--task {spec!r}: expected hf:DATASET[@SUBSET][:SPLIT]")
    return dataset, subset or None, split or "test"


def detect_columns(columns: list[str], preferred: tuple[str, str]) -> tuple[str, str]:
    """(question, answer) column names: ``preferred`` when present, else the first known alias."""
    found = []
    for want, aliases, what in ((preferred[0], QUESTION_KEYS, "question"), (preferred[1], ANSWER_KEYS, "answer")):
        pick = want if want in columns else next((a for a in aliases if a in columns), None)
        if pick is None:
            raise TaskError(f"no {what} column among {sorted(columns)}; known names: {', '.join(aliases)}. "
                            f"Set task.{what}_key=COLUMN")
        found.append(pick)
    return found[0], found[1]


def _math_set(name: str, base, dataset: str, split: str, subset: Optional[str], num_items: Optional[int],
              keys: Optional[tuple[str, str]]) -> EvalSet:
    try:
        rows = load_rows(dataset, split, subset)
    except TaskError as exc:
        hint = "" if Path(dataset).suffix.lower() in _FILE_FORMATS else (
            f". Without network, download it elsewhere and pass a local copy: --task {name}=FILE.parquet")
        raise TaskError(f"{exc}{hint}") from exc
    if not rows:
        raise TaskError(f"--task {name}: dataset {dataset!r} is empty")
    question_key, answer_key = detect_columns(list(rows[0]), keys or (base.question_key, base.answer_key))
    cfg = dataclasses.replace(base, kind="math", name=dataset, split=split, subset=subset, eval_size=0,
                              question_key=question_key, answer_key=answer_key)
    task = build_task(cfg)  # eval_size=0: every usable row is in task.items
    return EvalSet(name, task, _first(task.items, num_items), cfg)
