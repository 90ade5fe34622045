"""Tasks: where prompts come from, how they are rendered, and how responses are scored.

Three sources (config ``task.*``):
- ``reasoning_gym``: a procedural generator by name, scored by the generator's own
  ``score_answer`` on the extracted final answer;
- ``math``: question/answer rows from a local jsonl/json/parquet/csv file or an HF dataset,
  scored with math-verify;
- ``reward_fn = "module:function"``: a custom scorer replacing either.

The final answer is the content of the last ``\\boxed{...}``; a response without one scores 0.
Scoring never raises (KeyboardInterrupt aside): a scorer that raises (``SystemExit`` included),
hangs past ``reward_timeout_s`` or returns a non-number, or a number that is not finite as a
float32, scores 0 and is counted (:class:`ScoreStats`).

This module knows nothing about models' weights, the loss or the engines.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import signal
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from mugrpo.errors import UserError


class TaskError(UserError, ValueError):
    """A dataset or task that cannot be used; the message says what is wrong and the fix."""


@dataclass
class Item:
    question: str
    answer: str
    entry: dict = field(default_factory=dict)
    """The source row (reasoning-gym entry or dataset row), passed to scorers."""


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{"): i - 1].strip()
        start = text.rfind("\\boxed{", 0, start)
    return None


# ---------------------------------------------------------------------------------------------
# Scoring with fault isolation.


class RewardTimeout(Exception):
    pass


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn()``; raise RewardTimeout after ``timeout_s`` (SIGALRM; main thread only, else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return fn()

    def on_alarm(signum, frame):
        raise RewardTimeout(f"reward call exceeded {timeout_s:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class ScoreStats:
    num_scored: int = 0
    num_errors: int = 0
    num_timeouts: int = 0
    num_invalid: int = 0
    """Scorer returned None, NaN, inf, a number beyond float32's range or a non-number."""
    num_unparsable: int = 0
    """No ``\\boxed{}`` answer found (scored 0 by the built-in scorers)."""
    first_error: Optional[str] = None


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _as_reward(value: Any) -> Optional[float]:
    """``value`` as a float that is finite once stored as float32 (rewards are), else None.

    1e39 is a finite float64 but inf in float32, and an inf reward turns every advantage of its
    group into NaN, so it is as invalid as NaN itself."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        reward = float(value)
    except (OverflowError, ValueError):  # e.g. an int beyond float64
        return None
    return reward if math.isfinite(reward) and abs(reward) <= _FLOAT32_MAX else None


class Task:
    """Items for training and held-out evaluation, plus a scorer ``score(completion, item) -> float``."""

    def __init__(self, name: str, items: list[Item], eval_items: list[Item],
                 scorer: Callable[[str, Item], float], timeout_s: float = 10.0):
        if not items:
            raise TaskError(f"task {name!r} has no usable training items")
        self.name, self.items, self.eval_items = name, items, eval_items
        self._scorer, self.timeout_s = scorer, timeout_s

    def score_all(self, completions: list[str], items: list[Item]) -> tuple[torch.Tensor, ScoreStats]:
        stats = ScoreStats()
        rewards = []
        for text, item in zip(completions, items):
            stats.num_scored += 1
            if self._scorer.__name__.startswith("_builtin") and extract_boxed(text) is None:
                stats.num_unparsable += 1
            try:
                value = call_with_timeout(lambda: self._scorer(text, item), self.timeout_s)
            except RewardTimeout:
                stats.num_timeouts += 1
                value = 0.0
            except KeyboardInterrupt:  # Ctrl-C must still stop the run
                raise
            except BaseException:  # noqa: BLE001 - a user scorer may raise anything, sys.exit() included
                stats.num_errors += 1
                stats.first_error = stats.first_error or traceback.format_exc()
                value = 0.0
            reward = _as_reward(value)
            if reward is None:
                stats.num_invalid += 1
                reward = 0.0
            rewards.append(reward)
        return torch.tensor(rewards, dtype=torch.float32), stats

    def sample(self, count: int, generator: torch.Generator) -> list[int]:
        """``count`` training item indices, without replacement until the pool is exhausted."""
        n = len(self.items)
        perms = [torch.randperm(n, generator=generator) for _ in range(-(-count // n))]
        return torch.cat(perms)[:count].tolist()


# ---------------------------------------------------------------------------------------------
# Builders.


def _load_reward_fn(spec: str) -> Callable[[str, str, dict], float]:
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):  # not found itself
            raise TaskError(f"task.reward_fn={spec!r}: cannot import module {module_name!r} ({exc}); "
                            "make sure it is on PYTHONPATH") from exc
        raise TaskError(_import_failure(spec, module_name, exc)) from exc
    except Exception as exc:  # noqa: BLE001 - the module's own code failed (SyntaxError, a raise at import)
        raise TaskError(_import_failure(spec, module_name, exc)) from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskError(f"task.reward_fn={spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def _import_failure(spec: str, module_name: str, exc: BaseException) -> str:
    """The message for a reward module found but failing inside its own import: the real cause and where."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{f.filename}:{f.lineno}" for f in reversed(frames) if "importlib" not in f.filename), None)
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f"{exc.filename}:{exc.lineno}"
    return (f"task.reward_fn={spec!r}: importing module {module_name!r} failed inside the module: "
            f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")
            + ". Fix the module or install what it imports")


def build_task(task_cfg) -> Task:
    if task_cfg.kind == "reasoning_gym":
        name, items, eval_items, scorer = _reasoning_gym(task_cfg)
    else:
        name, items, eval_items, scorer = _math(task_cfg)
    if task_cfg.reward_fn:
        user_fn = _load_reward_fn(task_cfg.reward_fn)

        def scorer(text: str, item: Item) -> float:
            return user_fn(text, item.answer, item.entry)

    items, eval_items = clean_split(name, items, eval_items, task_cfg.eval_size)
    return Task(name, items, eval_items, scorer, task_cfg.reward_timeout_s)


def question_key(question: str) -> str:
    """The text two questions are compared by: case and runs of whitespace do not count."""
    return " ".join(question.split()).casefold()


MIN_TRAIN_SHARE = 2 / 3
"""The share of its distinct questions that training keeps when held-out items must be taken from it."""


def clean_split(name: str, items: list[Item], eval_items: list[Item], eval_size: int) -> tuple[list[Item], list[Item]]:
    """Held-out items that never occur in training, compared by question text (:func:`question_key`).

    The held-out set is deduplicated and cut to ``eval_size``; every training item whose question
    is held out leaves training. A task with a small pool of questions (the default task has 242)
    would lose most of them, so held-out questions are taken from training only while training keeps
    at least ``MIN_TRAIN_SHARE`` of its distinct questions; the held-out set is smaller than
    ``eval_size`` then, and a note says so.
    """
    train_keys = {question_key(item.question) for item in items}
    budget = int(len(train_keys) * (1 - MIN_TRAIN_SHARE))
    held_out, held_keys, taken, refused = [], set(), 0, 0
    for item in eval_items:
        key = question_key(item.question)
        if len(held_out) == eval_size or key in held_keys:
            continue
        if key in train_keys:
            if taken == budget:
                refused += 1
                continue
            taken += 1
        held_out.append(item)
        held_keys.add(key)
    train = [item for item in items if question_key(item.question) not in held_keys]
    if refused and len(held_out) < eval_size:
        print(f"[mugrpo] note: task {name!r}: {len(held_out)} held-out items instead of task.eval_size={eval_size}: "
              f"the task has {len(train_keys)} distinct training questions, and held-out questions are removed from "
              f"training only while training keeps {MIN_TRAIN_SHARE:.0%} of them (so held-out never occurs in "
              "training). Use harder task.params or a larger dataset for a larger held-out set")
    if not train:
        raise TaskError(f"task {name!r}: no training item is left once the held-out questions are removed; "
                        "lower task.eval_size")
    return train, held_out


def _reasoning_gym(task_cfg):
    import reasoning_gym

    def make(size: int, seed: int):
        try:
            return reasoning_gym.create_dataset(task_cfg.name, size=size, seed=seed, **task_cfg.params)
        except (KeyError, ValueError, TypeError, AssertionError) as exc:
            raise TaskError(f"reasoning-gym task {task_cfg.name!r} with params {task_cfg.params}: {exc}. "
                            "Check task.name and task.params (the generator's config fields)") from exc

    train = make(task_cfg.size, task_cfg.seed)
    held_out = make(max(2 * task_cfg.eval_size, 1), task_cfg.seed + 1)  # spares: duplicates leave
    datasets = {}

    def _builtin_rg(text: str, item: Item) -> float:
        answer = extract_boxed(text)
        if answer is None:
            return 0.0
        ds = datasets[item.entry.get("_split", "train")]
        return float(ds.score_answer(answer=answer, entry=item.entry))

    datasets["train"], datasets["eval"] = train, held_out
    items = [Item(str(e["question"]), str(e["answer"]), {**e, "_split": "train"}) for e in train]
    eval_items = [Item(str(e["question"]), str(e["answer"]), {**e, "_split": "eval"}) for e in held_out]
    return task_cfg.name, items, eval_items, _builtin_rg


_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(name: str, split: str = "train", subset: Optional[str] = None) -> list[dict]:
    """Rows from a local file (jsonl/json/parquet/csv) or a Hugging Face dataset ``name``."""
    import datasets

    path = Path(name).expanduser()
    suffix = path.suffix.lower()  # data.JSONL is a jsonl file too
    try:
        if suffix in _FILE_FORMATS:
            if not path.is_file():
                raise TaskError(f"dataset file {name!r} does not exist")
            if path.stat().st_size == 0:
                raise TaskError(f"dataset file {name!r} is empty")
            ds = datasets.load_dataset(_FILE_FORMATS[suffix], data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(name, subset, split=split)
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; all mean "cannot load"
        if suffix == ".jsonl":
            _check_jsonl_rows(path)  # datasets' own error names no line: find the first bad one
        cause = exc
        while cause.__cause__ or cause.__context__:  # datasets wraps the parser's error, which says why
            cause = cause.__cause__ or cause.__context__
        detail = f"{exc}" if cause is exc else f"{exc} Cause: {type(cause).__name__}: {cause}"
        raise TaskError(f"could not load dataset {name!r} (split {split!r}): {' '.join(detail.split())}") from exc
    return list(ds)


def _check_jsonl_rows(path: Path) -> None:
    """TaskError naming the file, the line and the cause of the first line that is not a JSON object."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
                row = json.loads(line.strip()) if line.strip() else {}
            except UnicodeDecodeError as exc:
                raise TaskError(f"dataset file {str(path)!r}, line {number}: not UTF-8 text ({exc.reason}); "
                                "fix or delete that line") from exc
            except json.JSONDecodeError as exc:
                raise TaskError(f"dataset file {str(path)!r}, line {number}: not valid JSON ({exc.msg} at column "
                                f"{exc.colno}); fix or delete that line") from exc
            if not isinstance(row, dict):
                raise TaskError(f"dataset file {str(path)!r}, line {number}: a JSON {type(row).__name__}, not an "
                                "object of columns (e.g. {\"question\": ..., \"answer\": ...})")


def _math(task_cfg):
    from math_verify import parse, verify

    rows = load_rows(task_cfg.name, task_cfg.split, task_cfg.subset)
    if not rows:
        raise TaskError(f"dataset {task_cfg.name!r} is empty")
    for key in (task_cfg.question_key, task_cfg.answer_key):
        if key not in rows[0]:
            raise TaskError(f"dataset {task_cfg.name!r} has no column {key!r}; its columns are "
                            f"{sorted(rows[0])}. Set task.question_key / task.answer_key")
    items, num_bad = [], 0
    for row in rows:
        q, a = row.get(task_cfg.question_key), row.get(task_cfg.answer_key)
        if q is None or a is None or not str(q).strip() or not str(a).strip():
            num_bad += 1
            continue
        items.append(Item(str(q), str(a), dict(row)))
    if num_bad:
        print(f"[mugrpo] warning: skipped {num_bad} of {len(rows)} rows of {task_cfg.name!r} with an empty "
              f"{task_cfg.question_key!r} or {task_cfg.answer_key!r}")
    if not items:
        raise TaskError(f"dataset {task_cfg.name!r}: no row has both a question and an answer")
    n_eval = min(task_cfg.eval_size, len(items) // 2)
    train, held_out = (items[:-n_eval], items[-n_eval:]) if n_eval else (items, [])

    def _builtin_math(text: str, item: Item) -> float:
        answer = extract_boxed(text)
        if answer is None:
            return 0.0
        return float(verify(parse(gold_latex(item.answer)), parse(f"\\boxed{{{answer}}}")))

    return task_cfg.name, train, held_out, _builtin_math


def gold_latex(answer: str) -> str:
    """math-verify parses a bare gold string like ``(x+1)^2`` to nothing; wrap it in \\boxed{}."""
    return answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"


# ---------------------------------------------------------------------------------------------
# Prompt rendering.


def render_messages(question: str, task_cfg) -> list[dict]:
    def user(q: str) -> str:
        return f"{q}\n\n{task_cfg.instruction}" if task_cfg.instruction else q

    messages = [{"role": "system", "content": task_cfg.system_prompt}] if task_cfg.system_prompt else []
    for shot in task_cfg.few_shot:
        messages += [{"role": "user", "content": user(shot["question"])},
                     {"role": "assistant", "content": shot["answer"]}]
    return messages + [{"role": "user", "content": user(question)}]


def prompt_ids(tokenizer, question: str, task_cfg) -> list[int]:
    """Token ids of the rendered prompt (chat template with generation prompt, or plain text)."""
    messages = render_messages(question, task_cfg)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    # No chat template (e.g. a base model): plain "role: content" lines.
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def limit_prompts(prompts: list[list[int]], task_cfg, what: str) -> tuple[list[list[int]], list[int]]:
    """``task.prompt_too_long`` applied to prompts over ``task.max_prompt_tokens``, the one rule for
    training and evaluation: ``error`` raises, ``skip`` drops them, ``truncate`` keeps each one's
    tail. Returns the prompts and the indices (into ``prompts``) that were kept. ``what`` names the
    prompts in messages ("training", "evaluation")."""
    limit = task_cfg.max_prompt_tokens
    too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
    if not too_long:
        return prompts, list(range(len(prompts)))
    if task_cfg.prompt_too_long == "error":
        raise TaskError(f"{len(too_long)} {what} prompt(s) are longer than task.max_prompt_tokens={limit} "
                        f"(longest {max(len(prompts[i]) for i in too_long)} tokens). Raise the limit, or set "
                        "task.prompt_too_long=skip or truncate")
    if task_cfg.prompt_too_long == "truncate":
        return [p[-limit:] for p in prompts], list(range(len(prompts)))
    keep = [i for i in range(len(prompts)) if len(prompts[i]) <= limit]
    if not keep:
        raise TaskError(f"every {what} prompt is longer than task.max_prompt_tokens={limit}; raise the limit")
    return [prompts[i] for i in keep], keep
