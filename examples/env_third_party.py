"""A third-party environment, unchanged: skyrl-gym's ``gsm8k_multi_turn``, offline.

    .venv/bin/python examples/env_third_party.py                    # SmolLM2-135M-Instruct, 8 updates

skyrl-gym (pinned in requirements.lock) ships text environments in the same shape as mugrpo's
(action text in; messages, reward, done out). ``gsm8k_multi_turn`` asks for an answer in the form
``#### n`` and re-prompts until it is right or ``max_turns`` is reached; its reward per turn is 1
for the right answer and a small format score for a well-formed wrong one. The adapter
(``task.env: skyrl_gym``, ``task.env_args: {env_id: gsm8k_multi_turn, max_turns: 3}``) passes each
row's answer as skyrl's ground truth. The environment scores the answers itself, so the task's
reward here is zero (``no_task_reward``). Logged per stage: ``env/reward_mean``, ``env/steps``,
``env/turns_mean``, ``reward/mean``.
"""

from __future__ import annotations

import argparse
import random

import mugrpo

INSTRUCTION = "Reason step by step, then give the final answer as '#### <number>'."


def no_task_reward(prompts, completions, **kwargs) -> list[float]:
    """The environment's rewards are the whole signal; the task adds nothing."""
    return [0.0] * len(completions)


def word_problem_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        boxes, per_box, eaten = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 9)
        question = (f"Sam has {boxes} boxes with {per_box} apples in each. He eats {eaten} apples. "
                    "How many apples are left?")
        rows.append({"question": question, "answer": str(boxes * per_box - eaten)})
    return rows


def main(argv=None) -> mugrpo.TrainResult:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-turns", type=int, default=3)
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
                 "env_args": {"env_id": "gsm8k_multi_turn", "max_turns": args.max_turns}},
        "eval.num_items": 16,
    }
    result = mugrpo.train(config, train_dataset=word_problem_rows(args.rows), environment="skyrl_gym",
                          reward_funcs=[no_task_reward], run_dir=args.run_dir)
    for stage in result.metrics("stage"):
        print(f"stage {stage['stage']}: reward {stage['reward/mean']:.3f}  "
              f"turns {stage.get('env/turns_mean', 0):.2f}")
    print(f"run directory: {result.run_dir}  final model: {result.final_model}")
    return result


if __name__ == "__main__":
    main()
