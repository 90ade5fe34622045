"""Does the built-in SmolLM2 call the calculator tool before any training? (tool-call rate at step 0)

    PYTHONPATH=. .venv/bin/python -m benchmarks env_tool_call_rate [--samples 4] [--out FILE]

Three prompts for the same two arithmetic questions (3-digit x 2-digit + 3-digit), each sampled
``--samples`` times at temperature 1 through the real multi-turn loop (HF engine, fp32):

- ``protocol``: the calculator environment's own prompt (the ``<tool_call>`` protocol in the system
  message, as for any template without tool support);
- ``example_call``: the same, and the instruction shows a call;
- ``demonstration``: the same, after a worked demonstration conversation (call, tool response,
  boxed answer).

Writes ``benchmarks/results/env_tool_call_rate.json`` (the suite's schema; figures: one row per
prompt variant, rewritten after each): trajectories, tool calls, tool errors, end reasons,
correct final answers, wall time. RL needs a non-zero tool-call rate to learn tool use from.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from benchmarks.suite import common_arguments, write_result

QUESTIONS = [("What is 347 * 58 + 912?", "21038"), ("What is 615 * 23 + 487?", "14632")]
INSTRUCTION = "Use the calculate tool, then put your final answer within \\boxed{}."
EXAMPLE = ('First call the calculate tool, for example <tool_call>{"name": "calculate", "arguments": '
           '{"expression": "12 * 7 + 5"}}</tool_call>, then put your final answer within \\boxed{}.')


def demo_environment(instruction: str):
    from mugrpo.rollout.envs.builtin import CalculatorEnvironment

    class Demonstrated(CalculatorEnvironment):
        def reset(self, item, seed):
            call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "214 * 37 + 655"}}\n</tool_call>'
            return [{"role": "user", "content": f"What is 214 * 37 + 655?\n\n{instruction}"},
                    {"role": "assistant", "content": call},
                    {"role": "user", "content": "<tool_response>\n8573\n</tool_response>"},
                    {"role": "assistant", "content": "214 * 37 + 655 = 8573. The final answer is \\boxed{8573}."},
                    {"role": "user", "content": f"{item.question}\n\n{instruction}"}]

    return Demonstrated


def run_variant(name: str, engine, tok, samples: int) -> dict:
    from mugrpo.config import TaskConfig
    from mugrpo.rollout.engines.base import SamplingConfig
    from mugrpo.rollout.envs.builtin import CalculatorEnvironment
    from mugrpo.rollout.multiturn import LoopContext, LoopLimits, roll_out_items
    from mugrpo.rollout.tasks import Item, _math_verify

    instruction = EXAMPLE if name == "example_call" else INSTRUCTION
    env_cls = demo_environment(INSTRUCTION) if name == "demonstration" else CalculatorEnvironment
    items = [Item(q, a) for q, a in QUESTIONS]
    start = time.monotonic()
    ctx = LoopContext(engine, tok, LoopLimits(max_turns=3, max_response_tokens=200),
                      TaskConfig(instruction=instruction, few_shot=[]))
    _, prompts, trajs = roll_out_items(ctx, lambda: env_cls(max_turns=3), items,
                                       SamplingConfig(n=samples, max_new_tokens=96, seed=0), reset_seed=0)
    flat = [item for item in items for _ in range(samples)]
    return {"variant": name, "num_trajectories": len(trajs), "prompt_tokens": [len(p) for p in prompts],
            "num_tool_calls": sum(t.metadata.get("tool_calls", 0) for t in trajs),
            "num_tool_errors": sum(t.metadata.get("tool_errors", 0) for t in trajs),
            "end_reasons": dict(Counter(t.end_reason for t in trajs)),
            "num_correct": sum(_math_verify(t.final_text, item) for t, item in zip(trajs, flat)),
            "wall_s": round(time.monotonic() - start, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4)
    common_arguments(p, "env_tool_call_rate")
    args = p.parse_args(argv)
    from mugrpo.config import RolloutConfig
    from mugrpo.models.loading import load_tokenizer, resolve_model_path
    from mugrpo.rollout.engines.hf import HFEngine

    path = resolve_model_path("smollm2-135m-instruct")
    tok = load_tokenizer(path)
    engine = HFEngine(path, tok, RolloutConfig(batch_size=16, dtype="float32"))
    rows, names = [], ("protocol", "example_call", "demonstration")
    for name in names:
        rows.append(run_variant(name, engine, tok, args.samples))
        print(json.dumps(rows[-1]))
        write_result(args.out, "env_tool_call_rate", {"rows": rows}, args, finished=len(rows) == len(names),
                     threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
