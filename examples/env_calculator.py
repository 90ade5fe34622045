"""Run GRPO on SmolLM2 with a calculator tool available, on arithmetic it cannot do in its head.

What this shows is the wiring (a tool given as a Python function, the ``<tool_call>`` protocol, the
multi-turn rollout and its metrics), not a model learning to use the tool: measured, SmolLM2-135M-
Instruct never emits a tool call here (``env/tool_calls`` stays 0), so there is no tool-use reward
signal to learn from (docs/BENCHMARKS.md section 8). A model that already calls tools, or one first
taught the protocol by a warm start (``mugrpo sft``, docs/WARMSTART.md), is needed for that:
docs/BENCHMARKS.md section 10 warm-starts SmolLM2 for 3 steps, then RL teaches it a two-call plan
(``benchmarks/smollm/tool_rl.py``).

    .venv/bin/python examples/env_calculator.py                     # SmolLM2-135M-Instruct, 8 updates
    .venv/bin/python examples/env_calculator.py --updates 32 --run-dir runs/calculator

The tool is a plain Python function with type hints and a docstring, given as TRL users give
tools (``mugrpo.train(..., tools=[calculate])``; in a config file: ``task.tools:
["mugrpo.rollout.envs.builtin:calculate"]``, or ``task.env: calculator``). SmolLM2's chat template has
no tool support, so the system prompt teaches the ``<tool_call>`` protocol (docs/ENVIRONMENTS.md);
each call's result comes back as a ``<tool_response>`` turn, and a turn without a call is the
final answer, scored by the task's correctness (math-verify of the last ``\\boxed{}``).
The questions (a 3-digit by 2-digit product plus a 3-digit number) are ones the 135M model mostly
gets wrong without the tool. Logged per stage: ``env/tool_calls``, ``env/tool_errors`` and the rest
of the tool counts, ``env/turns_mean``, ``reward/mean``.
"""

from __future__ import annotations

import argparse
import random

import mugrpo
from mugrpo.rollout.envs.builtin import calculate

INSTRUCTION = "Use the calculate tool, then put your final answer within \\boxed{}."


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
        rows.append({"question": f"What is {a} * {b} + {c}?", "answer": str(a * b + c)})
    return rows


def main(argv=None) -> mugrpo.TrainResult:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--max-new-tokens", type=int, default=160, help="per trajectory: policy and tool tokens")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="the tool instructions make prompts long")
    args = p.parse_args(argv)
    config = {
        "preset": "mu-grpo",
        "model.name": args.model,
        "schedule.total_updates": args.updates,
        "schedule.num_stages": 2,
        "schedule.prompts_per_update": 4,
        "rollout.max_new_tokens": args.max_new_tokens,
        "env.max_turns": args.max_turns,
        "task": {"few_shot": [], "instruction": INSTRUCTION, "eval_size": 16,
                 "max_prompt_tokens": args.max_prompt_tokens},
        "eval.num_items": 16,
    }
    result = mugrpo.train(config, train_dataset=arithmetic_rows(args.rows), tools=[calculate], run_dir=args.run_dir)
    for stage in result.metrics("stage"):
        counts = "  ".join(f"{k[4:]} {v:g}" for k, v in stage.items() if k.startswith("env/tool_") and v is not None)
        print(f"stage {stage['stage']}: reward {stage['reward/mean']:.3f}  {counts}")
    print(f"run directory: {result.run_dir}  final model: {result.final_model}")
    return result


if __name__ == "__main__":
    main()
