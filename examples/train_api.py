"""Train from Python: TRL-style data and reward functions, several rewards with weights.

    .venv/bin/python examples/train_api.py                       # SmolLM2-135M-Instruct, 8 updates
    .venv/bin/python examples/train_api.py --updates 32 --run-dir runs/api-demo

The data are rows with a ``prompt`` column (chat messages, as in TRL) and an ``answer`` column; a
``datasets.Dataset`` works the same. The training reward is the weighted sum of
- ``correctness`` (built in: math-verify against ``answer``), weight 1;
- ``boxed_format`` (built in: 1 if the response has a \\boxed{} answer), weight 0.2;
- ``concise``, a TRL-style function defined here, weight 0.1.
Each is logged on its own (``reward/<name>/mean`` in metrics.jsonl), and so is the sum (``reward/mean``).

Measured 2026-12-01 (CPU capability AVX512, 2 cores shared with other jobs, HF engine, bf16): 8 min 35 s;
stage rewards 0.458 -> 0.838 (correctness 0.219 -> 0.562, boxed_format 0.828 -> 0.992), one seed.
"""

from __future__ import annotations

import argparse
import random

import mugrpo


def concise(prompts, completions, **kwargs) -> list[float]:
    """TRL's reward signature: completions are chat messages here, because the prompts are."""
    return [1.0 - min(len(c[0]["content"]), 200) / 200 for c in completions]


INSTRUCTION = "Put your final answer within \\boxed{}."
ONE_SHOT = [{"role": "user", "content": f"What is 13 + 24? {INSTRUCTION}"},  # chat messages are used as they are
            {"role": "assistant", "content": "13 + 24 = 37. The final answer is \\boxed{37}."}]


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [*ONE_SHOT, {"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}],
                     "answer": str(a + b)})
    return rows


def main(argv=None) -> mugrpo.TrainResult:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    config = {
        "preset": "mu-grpo",
        "model.name": args.model,
        "schedule.total_updates": args.updates,
        "schedule.num_stages": 2,
        "schedule.prompts_per_update": 4,
        "rollout.max_new_tokens": args.max_new_tokens,
        "task": {"few_shot": [], "instruction": "", "eval_size": 16},
        "eval.num_items": 16,
    }
    result = mugrpo.train(config, train_dataset=arithmetic_rows(256),
                          reward_funcs=["correctness", "boxed_format", concise], reward_weights=[1.0, 0.2, 0.1],
                          run_dir=args.run_dir)
    for stage in result.metrics("stage"):
        parts = "  ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in stage.items() if k.endswith("/mean") and k.count("/") == 2)
        print(f"stage {stage['stage']}: reward {stage['reward/mean']:.3f}  ({parts})")
    print(f"run directory: {result.run_dir}  final model: {result.final_model}")
    return result


if __name__ == "__main__":
    main()
