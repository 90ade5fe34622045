"""Tasks: where prompts come from, how they are rendered, and which rewards score the responses.

Sources (config ``task.*``):
- ``reasoning_gym``: a procedural generator by name, whose correctness is the generator's own
  ``score_answer`` on the extracted final answer;
- ``math``: rows from a local jsonl/json/parquet/csv file or an HF dataset, whose correctness is
  math-verify against the row's answer;
- rows given from Python (``mugrpo.train(train_dataset=...)``, ``task.kind=rows``).

A row's prompt is its ``task.question_key`` column (a question, rendered with the task's instruction,
few-shot turns and system prompt), or else a ``prompt`` column as in TRL: a string (the question) or
a list of chat messages (used as they are). Its answer is ``task.answer_key``, else ``solution``,
else verl's ``reward_model.ground_truth``.

The rewards (:mod:`mugrpo.rollout.rewards`): ``task.rewards`` (several, weighted), else ``task.reward_fn``
(one function replacing correctness), else correctness. The final answer is the content of the last
``\\boxed{...}``; a response without one scores 0. Held-out items never occur in training
(:func:`clean_split`).

This module knows nothing about models' weights, the loss or the engines.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from mugrpo.errors import TaskError
from mugrpo.rollout import TASK_KINDS
from mugrpo.rollout.rewards import RewardFn, ScoreStats, make_reward, score
from mugrpo.rollout.text_cut import char_limit, cut_messages

__all__ = ["Item", "Task", "TaskError", "ScoreStats", "build_task", "clean_split", "extract_boxed", "prompt_ids"]


@dataclass
class Item:
    question: str
    answer: str
    entry: dict = field(default_factory=dict)
    """The source row (reasoning-gym entry or dataset row), passed to scorers."""
    messages: Optional[list] = None
    """A prompt given as chat messages (a ``prompt`` column, as TRL's): used as they are."""

    @property
    def prompt(self):
        """What the policy is prompted with: the chat messages, or the question."""
        return self.messages if self.messages is not None else self.question


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
# The task.


class Task:
    """Items for training and held-out evaluation, and the rewards that score responses to them.

    ``rewards`` is a list of :class:`mugrpo.rollout.rewards.RewardFn` (the training reward is their weighted
    sum), or one function ``score(completion, item) -> float``. Evaluation scores with
    ``rewards[eval_reward]`` alone when it is given (the task's correctness), else with the sum.
    """

    def __init__(self, name: str, items: list[Item], eval_items: list[Item], rewards, timeout_s: float = 10.0,
                 eval_reward: Optional[int] = None):
        if not items:
            raise TaskError(f"task {name!r} has no usable training items")
        self.name, self.items, self.eval_items = name, items, eval_items
        self.rewards = rewards if isinstance(rewards, list) else [RewardFn("reward", rewards, builtin=True)]
        self.timeout_s, self.eval_reward = timeout_s, eval_reward

    def score_all(self, completions: list[str], items: list[Item]) -> tuple[torch.Tensor, ScoreStats]:
        """The training reward of each completion (the weighted sum), and what happened per function."""
        return score(self.rewards, completions, items, self.timeout_s, extract_boxed)

    def score_eval(self, completions: list[str], items: list[Item]) -> tuple[torch.Tensor, ScoreStats]:
        """The evaluation score: the correctness reward alone when the task has one among several."""
        rewards = self.rewards if self.eval_reward is None else [
            dataclasses.replace(self.rewards[self.eval_reward], weight=1.0)]
        return score(rewards, completions, items, self.timeout_s, extract_boxed)

    def sample(self, count: int, generator: torch.Generator) -> list[int]:
        """``count`` training item indices, without replacement until the pool is exhausted."""
        n = len(self.items)
        perms = [torch.randperm(n, generator=generator) for _ in range(-(-count // n))]
        return torch.cat(perms)[:count].tolist()


# ---------------------------------------------------------------------------------------------
# Builders.


def build_task(task_cfg, rows: Optional[list[dict]] = None, eval_rows: Optional[list[dict]] = None) -> Task:
    """The task ``task_cfg`` describes; ``rows`` (and ``eval_rows``) are data given from Python
    (:func:`mugrpo.train`), used in place of loading ``task.name``."""
    if rows is not None:
        name, items, eval_items, correctness = _python_rows(task_cfg, rows, eval_rows)
    else:  # the source registered as task.kind (mugrpo.rollout.TASK_KINDS)
        name, items, eval_items, correctness = TASK_KINDS.get(task_cfg.kind)(task_cfg)
    if task_cfg.eval_path is not None:  # a held-out file named on the command line (task.eval_path)
        if eval_rows is not None:
            raise TaskError("task.eval_path and eval_dataset both name the held-out rows; give one of them")
        eval_items = _eval_file_items(task_cfg)
    rewards, eval_reward = _rewards(task_cfg, correctness)
    if any(r.builtin and r.fn is _math_verify for r in rewards):
        _require_answers(name, items + eval_items)
    items, eval_items = clean_split(name, items, eval_items, task_cfg.eval_size)
    return Task(name, items, eval_items, rewards, task_cfg.reward_timeout_s, eval_reward)


def _eval_file_items(task_cfg) -> list[Item]:
    """The held-out items of ``task.eval_path``, read as ``task.kind=math`` reads its file."""
    path = task_cfg.eval_path
    if Path(path).expanduser().suffix.lower() not in _FILE_FORMATS:
        raise TaskError(f"task.eval_path={path!r}: a local file ending in {', '.join(_FILE_FORMATS)} is needed")
    rows = load_rows(path)
    if not rows:
        raise TaskError(f"task.eval_path={path!r} has no rows")
    return items_from_rows(rows, task_cfg, f"task.eval_path={path!r}")


def rows_source(task_cfg):
    """``task.kind=rows`` without rows: the data were given from Python and are not in the config."""
    raise TaskError(f"task.name={task_cfg.name!r}: this run's data were passed from Python to mugrpo.train and "
                    "are not stored in its config; resume it from Python with the same data "
                    "(mugrpo.train(run_dir=..., train_dataset=..., resume=True)), and evaluate its model on a "
                    "named task or file (mugrpo eval --model RUN_DIR/final_model --task FILE.jsonl)")


def _rewards(task_cfg, correctness) -> tuple[list[RewardFn], Optional[int]]:
    """The reward functions (``task.rewards``, else ``task.reward_fn``, else correctness) and the index
    of the one evaluation scores with (correctness, when among several), or None for their sum."""
    builtins = {"correctness": correctness, "math_verify": _math_verify, "boxed_format": _boxed_format,
                NO_TASK_REWARD: _no_task_reward}
    specs = task_cfg.rewards or [{"fn": task_cfg.reward_fn or "correctness"}]
    rewards = [make_reward(spec["fn"], float(spec.get("weight", 1.0)), spec.get("name"), builtins) for spec in specs]
    names = [r.name for r in rewards]
    if len(set(names)) < len(names):
        raise TaskError(f"task.rewards: two rewards are named {sorted({n for n in names if names.count(n) > 1})}; "
                        "give each a distinct 'name'")
    correct = [i for i, spec in enumerate(specs) if _is_correctness(spec)]
    return rewards, (correct[0] if len(rewards) > 1 and correct else None)


def _is_correctness(spec) -> bool:
    return isinstance(spec, dict) and spec.get("fn") == "correctness"


def eval_task_config(task_cfg):
    """``task_cfg`` as evaluation on another dataset scores it: with ``correctness`` alone when it is
    among ``task.rewards`` (the rule :meth:`Task.score_eval` applies to the training task)."""
    if any(_is_correctness(spec) for spec in task_cfg.rewards):
        return dataclasses.replace(task_cfg, rewards=[])
    return task_cfg


def _require_answers(name: str, items: list[Item]) -> None:
    if any(not item.answer.strip() for item in items):
        raise TaskError(f"task {name!r}: math-verify correctness needs an answer for every row, and some have none. "
                        "Give the data an answer column (task.answer_key; 'answer' or 'solution' are found by "
                        "themselves), or score with your own reward functions only (task.rewards)")


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


def reasoning_gym_source(task_cfg):
    """``task.kind=reasoning_gym``: (name, items, eval items, correctness) of a procedural generator."""
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
            if suffix in (".json", ".jsonl"):
                _check_json_depth(path)
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


MAX_JSON_DEPTH = 100
"""Nesting levels a .json / .jsonl dataset may have: the JSON readers recurse once per level (Python's
raises RecursionError near 1000 levels, pyarrow's native reader crashes the process near 20000)."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _check_json_depth(path: Path) -> None:
    """TaskError when the file nests arrays or objects more than :data:`MAX_JSON_DEPTH` levels deep,
    checked before any JSON reader sees it (the strings' contents do not count)."""
    import numpy as np

    data = np.frombuffer(_JSON_STRING.sub(b'""', path.read_bytes()), dtype=np.uint8)
    depth = level = 0
    for start in range(0, len(data), 1 << 22):  # in chunks: a few bytes of memory per byte of the file at most
        chunk = data[start:start + (1 << 22)]
        opens = (chunk == ord("[")) | (chunk == ord("{"))
        step = opens.astype(np.int32) - ((chunk == ord("]")) | (chunk == ord("}")))
        levels = level + np.cumsum(step)
        depth, level = max(depth, int(levels.max())), int(levels[-1])
    if depth > MAX_JSON_DEPTH:
        raise TaskError(f"dataset file {str(path)!r} nests arrays or objects {depth} levels deep (at most "
                        f"{MAX_JSON_DEPTH} are read): the JSON readers recurse once per level. Flatten the data")


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


def math_source(task_cfg):
    """``task.kind=math``: (name, items, eval items, correctness) of a local file or HF dataset."""
    rows = load_rows(task_cfg.name, task_cfg.split, task_cfg.subset)
    if not rows:
        raise TaskError(f"dataset {task_cfg.name!r} is empty")
    items = items_from_rows(rows, task_cfg, repr(task_cfg.name))
    if task_cfg.eval_path is not None:  # the held-out rows are that file's: every row here trains
        return task_cfg.name, items, [], _math_verify
    return (task_cfg.name, *_tail_held_out(items, task_cfg.eval_size), _math_verify)


def _python_rows(task_cfg, rows, eval_rows):
    """Rows given from Python: held-out items are ``eval_rows``, else the last ``task.eval_size`` rows."""
    if not rows:
        raise TaskError("train_dataset is empty")
    items = items_from_rows(rows, task_cfg, "train_dataset")
    if eval_rows is None:  # with task.eval_path, build_task takes the held-out rows from that file
        held = task_cfg.eval_path is None
        return (task_cfg.name, *(_tail_held_out(items, task_cfg.eval_size) if held else (items, [])), _math_verify)
    held_out = items_from_rows(eval_rows, task_cfg, "eval_dataset") if eval_rows else []
    return task_cfg.name, items, held_out, _math_verify


def _tail_held_out(items: list[Item], eval_size: int) -> tuple[list[Item], list[Item]]:
    """(train, held-out): the last ``eval_size`` items held out, at most half of them."""
    n_eval = min(eval_size, len(items) // 2)
    return (items[:-n_eval], items[-n_eval:]) if n_eval else (items, [])


def answers_needed(task_cfg) -> bool:
    """Whether a reward checks the row's answer: a built-in ``correctness`` or ``math_verify``
    (the default when neither ``task.rewards`` nor ``task.reward_fn`` is set). Rows without an answer
    are kept for user rewards alone (they get an empty ``answer``)."""
    specs = task_cfg.rewards or [{"fn": task_cfg.reward_fn or "correctness"}]
    return any(isinstance(s, dict) and s.get("fn") in ("correctness", "math_verify") for s in specs)


def items_from_rows(rows: list, task_cfg, source: str) -> list[Item]:
    """Items from dataset rows (see the module doc for the columns read); rows without a prompt, or
    with an answer column but no answer when a reward checks answers (:func:`answers_needed`), are
    skipped with a warning; a missing column is an error."""
    first = rows[0]
    if not isinstance(first, dict):
        raise TaskError(f"{source}: rows must be mappings of column -> value, got {type(first).__name__}")
    prompt_key = task_cfg.question_key if task_cfg.question_key in first else "prompt" if "prompt" in first else None
    if prompt_key is None:
        raise TaskError(f"{source} has no column {task_cfg.question_key!r} and no 'prompt' column; its columns are "
                        f"{sorted(first)}. Set task.question_key, or give a 'prompt' column (a string or chat "
                        "messages, as in TRL; mugrpo.from_trl converts TRL- and verl-style rows)")
    answer_key = next((k for k in (task_cfg.answer_key, "solution") if k in first), None)
    need_answer = answer_key is not None and answers_needed(task_cfg)
    items, num_bad = [], 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TaskError(f"{source}, row {i}: a {type(row).__name__}, not a mapping of column -> value")
        prompt, answer = row.get(prompt_key), _answer_of(row, answer_key)
        if not _prompt_ok(prompt, source, i, prompt_key) or need_answer and not answer.strip():
            num_bad += 1
            continue
        messages = prompt if isinstance(prompt, list) else None
        question = "\n".join(str(m["content"]) for m in messages) if messages else str(prompt)
        _check_unicode(question, f"{source}, row {i}: the prompt")
        items.append(Item(question, answer, dict(row), messages))
    if num_bad:
        print(f"[mugrpo] warning: skipped {num_bad} of {len(rows)} rows of {source} with an empty "
              f"{prompt_key!r}" + (f" or {answer_key!r}" if need_answer else ""))
    if not items:
        raise TaskError(f"{source}: no row has " + ("both a prompt and an answer" if need_answer else "a prompt"))
    return items


def _check_unicode(text: str, where: str) -> None:
    """TaskError when ``text`` holds a lone surrogate (``"\\ud800"``: JSON can write one, no tokenizer
    takes it), found when the data load, not once the model has."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TaskError(f"{where} holds a lone surrogate {text[exc.start]!r} at character {exc.start} (half of a "
                        "UTF-16 pair, not a character); fix the text") from exc


def _answer_of(row: dict, answer_key: Optional[str]) -> str:
    if answer_key is not None:
        value = row.get(answer_key)
    else:  # verl: {"reward_model": {"ground_truth": ...}}
        truth = row.get("reward_model")
        value = truth.get("ground_truth") if isinstance(truth, dict) else None
    return "" if value is None else str(value)


def _prompt_ok(prompt, source: str, i: int, key: str) -> bool:
    """False for an empty prompt (the row is skipped); TaskError for chat messages that are malformed,
    or a prompt that is neither text nor messages (a number is almost surely the wrong column)."""
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise TaskError(f"{source}, row {i}: the prompt column {key!r} holds a {type(prompt).__name__} ({prompt!r}), "
                        "not text or chat messages. Point task.question_key at the question column, or convert "
                        "the prompts to strings")
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and {"role", "content"} <= set(m)):
                raise TaskError(f"{source}, row {i}: a chat-message prompt must be a list of {{'role': ..., "
                                f"'content': ...}} mappings; got {m!r}")
        return bool(prompt)
    return prompt is not None and bool(str(prompt).strip())


def _math_verify(text: str, item: Item) -> float:
    """1 if the last ``\\boxed{}`` answer equals the item's answer by math-verify, else 0."""
    from math_verify import parse, verify

    answer = extract_boxed(text)
    if answer is None:
        return 0.0
    return float(verify(parse(gold_latex(item.answer)), parse(f"\\boxed{{{answer}}}")))


NO_TASK_REWARD = "none"
"""``task.reward_fn=none``: the task scores nothing, for an environment that scores itself (its step
rewards are the whole reward; docs/ENVIRONMENTS.md). Refused without an environment."""


def _no_task_reward(text: str, item: Item) -> float:
    """0 for every response: the environment's reward is the trajectory's whole reward."""
    return 0.0


def _boxed_format(text: str, item: Item) -> float:
    """1 if the response gives a ``\\boxed{}`` answer, else 0."""
    return float(extract_boxed(text) is not None)


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


def prompt_ids(tokenizer, prompt: str | list, task_cfg) -> list[int]:
    """Token ids of the rendered prompt (chat template with generation prompt, or plain text).

    ``prompt`` is a question (rendered with the task's instruction, few-shot turns and system
    prompt) or a list of chat messages (used as they are): an :attr:`Item.prompt`. A message longer than
    the characters ``task.max_prompt_tokens`` can use is cut to its end first
    (:func:`mugrpo.rollout.text_cut.char_limit`): such a prompt is over the limit either way, and
    ``task.prompt_too_long`` acts on it (and counts it) as on any other."""
    messages = prompt if isinstance(prompt, list) else render_messages(prompt, task_cfg)
    messages = cut_messages(messages, char_limit(tokenizer, task_cfg.max_prompt_tokens), keep="end")[0]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    # No chat template (e.g. a base model): plain "role: content" lines.
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def longest_prompt_tokens(task: "Task", tokenizer, task_cfg, candidates: int = 16) -> int:
    """Tokens of the task's longest rendered prompt (training and held-out items), at most
    ``task.max_prompt_tokens`` (a longer one is cut, skipped or refused). Only the ``candidates``
    longest prompts by characters are rendered and tokenized: a 10,000-item task costs milliseconds."""
    prompts = {str(item.prompt): item.prompt for item in (*task.items, *task.eval_items)}
    longest = sorted(prompts, key=len, reverse=True)[:candidates]
    return min(max((len(prompt_ids(tokenizer, prompts[p], task_cfg)) for p in longest), default=1),
               task_cfg.max_prompt_tokens)


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
