"""Multi-attempt feedback: a wrong answer gets "Incorrect, try again." and another attempt.

    .venv/bin/python examples/env_multi_attempt.py                  # SmolLM2-135M-Instruct, 8 updates
    .venv/bin/python examples/env_multi_attempt.py --attempts 4 --discount 0.8

The built-in ``multi_attempt`` environment (``task.env: multi_attempt``, ``task.env_args:
{max_attempts: 3}``) checks each attempt with the task's own correctness (math-verify of the last
``\\boxed{}``). The reward is the correctness of the last attempt; with ``--discount`` d < 1 a
correct answer at attempt k earns d ** (k - 1). Logged per stage: ``env/num_attempts``,
``env/num_solved``, ``env/turns_mean``, ``reward/mean``.
"""

from __future__ import annotations

import argparse
import random

import mugrpo

INSTRUCTION = "Put your final answer within \\boxed{}."


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"What is {a} + {b} - {c}?", "answer": str(a + b - c)})
    return rows


def main(argv=None) -> mugrpo.TrainResult:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--max-new-tokens", type=int, default=160, help="per trajectory: every attempt and feedback")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--discount", type=float, default=1.0)
    args = p.parse_args(argv)
    config = {
        "preset": "mu-grpo",
        "model.name": args.model,
        "schedule.total_updates": args.updates,
        "schedule.num_stages": 2,
        "schedule.prompts_per_update": 4,
        "rollout.max_new_tokens": args.max_new_tokens,
        "env.max_turns": args.attempts,
        "task": {"few_shot": [], "instruction": INSTRUCTION, "eval_size": 16,
                 "env_args": {"max_attempts": args.attempts, "discount": args.discount}},
        "eval.num_items": 16,
    }
    result = mugrpo.train(config, train_dataset=arithmetic_rows(args.rows), environment="multi_attempt",
                          run_dir=args.run_dir)
    for stage in result.metrics("stage"):
        print(f"stage {stage['stage']}: reward {stage['reward/mean']:.3f}  "
              f"attempts {stage.get('env/num_attempts', 0):g}  solved {stage.get('env/num_solved', 0):g}")
    print(f"run directory: {result.run_dir}  final model: {result.final_model}")
    return result


if __name__ == "__main__":
    main()
