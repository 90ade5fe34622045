"""The rollout phase of the long toy lab: one whole mu-grpo stage against grpo's small refreshes.

The lab's runs log ``perf/generate_s`` per stage, but on a shared machine the load moves between
runs, so runs cannot be compared by their clocks. This script measures both shapes in one process,
interleaved, on the same prompts: the stale runs' stage (1,024 sequences = 2 ``generate`` calls of
512) against grpo's refreshes (64 sequences = 8 prompts x G = 8 per call, 16 calls for the same
1,024 sequences), alternating one 512-sequence call with eight 64-sequence calls so that a change
in load hits both alike. The engine is mugrpo's HF engine with the lab's rollout settings (bf16
where the CPU computes it natively, T = 1, up to the warm start's max_new_tokens).

    PYTHONPATH=. python -m benchmarks toy_lab_rollout_phase

Output: ``benchmarks/results/toy_lab_long_rollout.json`` and one line per shape on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.suite import common_arguments, write_result
from benchmarks.toy_lab import long_task


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "toy_lab_rollout_phase")
    args = ap.parse_args(argv)
    from mugrpo.config import load_config
    from mugrpo.rollout.engines.base import SamplingConfig
    from mugrpo.rollout.engines.hf import HFEngine
    from mugrpo.hardware import cpu_native_bf16
    from mugrpo.models.loading import load_tokenizer
    from mugrpo.rollout.tasks import build_task, prompt_ids

    torch.set_num_threads(1)
    spec = long_task.LongSpec()
    model_dir = long_task.build(spec)
    warm = json.loads((model_dir / "warmstart.json").read_text())
    dtype = "bfloat16" if cpu_native_bf16() else "float32"  # what rollout.dtype=auto chose in the lab's runs
    cfg = load_config("mu-grpo", overrides=long_task.task_overrides(spec) + [
        f"model.name={model_dir}", "rollout.batch_size=512", f"rollout.dtype={dtype}"])
    tokenizer = load_tokenizer(str(model_dir))
    task = build_task(cfg.task)
    engine = HFEngine(str(model_dir), tokenizer, cfg.rollout, seed=0, device="cpu")
    prompts = [prompt_ids(tokenizer, it.question, cfg.task) for it in task.items[:128]]
    sampling = SamplingConfig(n=8, temperature=1.0, max_new_tokens=warm["max_new_tokens"])
    shapes = {"stage (512 per call)": {"calls": 0, "seconds": 0.0, "tokens": 0},
              "grpo refresh (64 per call)": {"calls": 0, "seconds": 0.0, "tokens": 0}}

    def timed(shape, chunk, seed):
        t0 = time.perf_counter()
        out = engine.generate(chunk, dataclasses.replace(sampling, seed=seed))
        shapes[shape]["seconds"] += time.perf_counter() - t0
        shapes[shape]["calls"] += 1
        shapes[shape]["tokens"] += sum(len(c.token_ids) for group in out for c in group)

    for half in range(2):  # 2 x (one 512-call + eight 64-calls) = 1,024 sequences each shape
        block = prompts[64 * half: 64 * (half + 1)]
        timed("stage (512 per call)", block, 1000 + half)
        for j in range(8):
            timed("grpo refresh (64 per call)", block[8 * j: 8 * (j + 1)], 2000 + 8 * half + j)
    for name, s in shapes.items():
        s["ms_per_token"] = 1e3 * s["seconds"] / s["tokens"]
        print(f"[toy_lab] {name}: {s['calls']} calls, {s['tokens']} tokens, {s['seconds']:.1f} s, "
              f"{s['ms_per_token']:.3f} ms per generated token")
    ratio = shapes["grpo refresh (64 per call)"]["ms_per_token"] / shapes["stage (512 per call)"]["ms_per_token"]
    print(f"[toy_lab] grpo's refreshes / one stage, seconds per generated token: {ratio:.2f}x "
          f"(cpu capability {torch.backends.cpu.get_cpu_capability()}, engine dtype {dtype})")
    out = {"shapes": shapes, "ratio_grpo_over_stage": ratio, "engine_dtype": dtype,
           "max_new_tokens": warm["max_new_tokens"]}
    write_result(args.out, "toy_lab_rollout_phase", out, args, threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
