"""Demonstrations without a teacher model: solved tool traces written by the task, and a run's own
high-reward trajectories (rejection sampling).

**Solved traces.** A tool task that knows how to solve its items writes the trace itself:
:func:`solved_trace` takes the prompt, the calls a solver would make and the final answer, runs
each call through a real :class:`~mugrpo.rollout.envs.tools.ToolEnvironment` (so every tool reply
is exactly the message the rollout loop would append) and returns a TRL conversational row: one
assistant message per call (a policy turn stops at ``</tool_call>``), each followed by its tool
reply, then the answer. :func:`calculator_rows` does it for the built-in calculator, on
``examples/env_calculator.py``'s questions: one call (``a * b + c``) or two, where the second call
needs the first's result (``a * b`` first, then ``<that> + c * d``), so the model is shown reading a
tool reply back into its next call; a task one call always solves leaves RL nothing to improve.
:func:`write_jsonl` stores the rows; :func:`mugrpo.warmstart.data.load_demonstrations` reads them.

**Rejection sampling.** :func:`select_from_run` reads a run's complete stages
(``RUN_DIR/stages/stage_KKK/``, the shards ``shards.json`` lists) and keeps the trajectories whose
reward is at least a threshold, as :class:`~mugrpo.warmstart.render.Example` (the stored prompt and
response ids, the mask = the policy tokens, ``turns >= 0``), with the counts kept / total.

This module knows nothing about training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable, Optional

from mugrpo.rollout.envs.builtin import calculate, evaluate_arithmetic
from mugrpo.rollout.envs.tools import ToolEnvironment, tool_schemas
from mugrpo.run_dir import RunDir
from mugrpo.stages.data import StageDataError
from mugrpo.stages.shards import read_stage
from mugrpo.warmstart.data import tool_call_text
from mugrpo.warmstart.render import Example

__all__ = ["CALCULATOR_INSTRUCTION", "solved_trace", "calculator_rows", "write_jsonl", "select_from_run"]

CALCULATOR_INSTRUCTION = "Use the calculate tool, then put your final answer within \\boxed{}."
"""``examples/env_calculator.py``'s instruction."""


def solved_trace(prompt: list[dict], calls: list[tuple[str, dict]], answer: str, tools: list[Callable]) -> dict:
    """A TRL conversational row: ``prompt``, then for each ``(name, arguments)`` of ``calls`` an
    assistant message making that call and the tool's reply, then the assistant's ``answer``.

    Raises ValueError when a call fails (an unknown tool, bad arguments, the tool raising): a trace
    with a failed call is not a solved one."""
    env = ToolEnvironment(tools)
    messages = [dict(m) for m in prompt]
    for name, arguments in calls:
        result = env.step(tool_call_text(name, arguments))
        if result.metadata.get("tool_errors"):
            raise ValueError(f"tool call {name}({arguments}) failed: {result.observations[0]['content']}")
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]})
        messages += result.observations
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, "tools": tool_schemas(tools)}


def calculator_rows(n: int, seed: int = 0, num_calls: int = 2, prompt: Optional[Callable[[str], list[dict]]] = None
                    ) -> list[dict]:
    """``n`` solved calculator traces of ``num_calls`` (1 or 2) calls each, with the ``question`` and
    ``answer`` columns an RL task reads.

    ``prompt(question) -> messages``; by default one user message, the question then
    :data:`CALCULATOR_INSTRUCTION` (what ``examples/env_calculator.py``'s task renders: no few-shot,
    no system prompt). Give ``lambda q: render_messages(q, task_cfg)`` to match another task."""
    if num_calls not in (1, 2):
        raise ValueError(f"num_calls must be 1 or 2, got {num_calls}")
    prompt = prompt or (lambda q: [{"role": "user", "content": f"{q}\n\n{CALCULATOR_INSTRUCTION}"}])
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
        if num_calls == 1:
            question = f"What is {a} * {b} + {c}?"
            calls = [f"{a} * {b} + {c}"]
        else:
            d = rng.randint(10, 99)
            question = f"What is {a} * {b} + {c} * {d}?"
            calls = [f"{a} * {b}", f"{a * b} + {c} * {d}"]  # the second call reads the first reply
        answer = str(evaluate_arithmetic(calls[-1]))
        row = solved_trace(prompt(question), [("calculate", {"expression": e}) for e in calls],
                           f"The answer is \\boxed{{{answer}}}.", [calculate])
        rows.append({**row, "question": question, "answer": answer})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """``rows`` as JSON lines (the file :func:`mugrpo.warmstart.data.load_demonstrations` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def select_from_run(run_dir: str | Path, min_reward: float, finished_only: bool = True) -> tuple[list[Example], dict]:
    """The trajectories of ``run_dir``'s complete stages with reward >= ``min_reward``, and the counts
    ``num_total`` (trajectories read), ``num_kept``, ``num_unfinished`` (rewarded enough but cut at
    the token budget: left out when ``finished_only``), ``num_stages`` (complete stages read) and
    ``reward_max`` (the best reward read; None when none was).

    Each example's ``source`` is ``(stage, shard, sequence)``; its mask is the stored policy tokens
    (``turns >= 0``; every response token of single-turn data). A stage folder without
    ``shards.json`` is still being written (or was interrupted) and is skipped."""
    examples: list[Example] = []
    counts = {"num_total": 0, "num_kept": 0, "num_unfinished": 0, "num_stages": 0, "reward_max": None}
    for folder in sorted(RunDir(run_dir).stages.glob("stage_*")):
        try:
            parts = read_stage(folder)  # checksums verified: a damaged shard is an error naming it
        except StageDataError as exc:
            raise ValueError(f"{exc.path} cannot be read ({exc.why}): the run directory is damaged; move that "
                             "stage folder away, or give another run") from exc
        if parts is None:
            continue
        stage = int(folder.name.split("_")[-1])
        counts["num_stages"] += 1
        for shard, data in enumerate(parts):
            for s, response in enumerate(data.responses):
                counts["num_total"] += 1
                reward = float(data.rewards[s])
                counts["reward_max"] = reward if counts["reward_max"] is None else max(counts["reward_max"], reward)
                if reward < min_reward:
                    continue
                if finished_only and not bool(data.finished[s]):
                    counts["num_unfinished"] += 1
                    continue
                turns = data.turns_of(s)
                examples.append(Example(list(data.prompts[s // data.group_size]), list(response), list(turns),
                                        [int(k >= 0) for k in turns], (stage, shard, s)))
    counts["num_kept"] = len(examples)
    return examples, counts
