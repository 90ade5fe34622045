"""How much a slow environment costs the multi-turn loop: wall-clock of a stage whose environment
steps sleep, with the step pool at 1 worker (serial) and at ``--workers``.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m benchmarks multiturn_env_pool --trajectories 32 --sleep 0.2

The engine is the tiny model on the HF engine (CPU), so the generation share is small and the
difference between the two runs is the environment time the pool overlaps. Writes
benchmarks/results/multiturn_env_pool.json (the suite's schema). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.suite import common_arguments, write_result
from mugrpo.config import RolloutConfig
from mugrpo.models.loading import load_tokenizer
from mugrpo.models.tiny import build_tiny_model
from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.engines.hf import HFEngine
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, loop_metrics, run_trajectories


class SleepyEnv(Environment):
    """Every step sleeps ``seconds`` (a slow tool or simulator), then asks again; done at turn 3."""

    max_turns = 3
    stop = tuple("aeiouAEIOU")  # the random tiny model then ends nearly every turn within 64 tokens

    def __init__(self, seconds: float):
        self.seconds, self.n = seconds, 0

    def step(self, action):
        time.sleep(self.seconds)
        self.n += 1
        return StepResult([{"role": "user", "content": "again"}], done=self.n == self.max_turns)


def stage(engine, tok, prompts, G, seconds, workers):
    envs = [SleepyEnv(seconds) for _ in range(len(prompts) * G)]
    t0 = time.perf_counter()
    ctx = LoopContext(engine, tok, LoopLimits(max_turns=3, max_response_tokens=256, max_workers=workers),
                      render_env_turn=lambda m, eos: tok("\nu:again\na:")["input_ids"], eos=[tok.eos_token_id])
    trajs = run_trajectories(ctx, prompts, envs, SamplingConfig(max_new_tokens=64, seed=0))
    return time.perf_counter() - t0, loop_metrics(trajs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--sleep", type=float, default=0.2)
    parser.add_argument("--workers", type=int, default=16)
    common_arguments(parser, "multiturn_env_pool")
    args = parser.parse_args(argv)
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "model")
    tok = load_tokenizer(str(model))
    engine = HFEngine(str(model), tok, RolloutConfig(batch_size=256, dtype="float32"))
    prompts = [tok(f"u:{i} + 1\na:")["input_ids"] for i in range(args.trajectories // args.group_size)]
    result = {"trajectories": args.trajectories, "sleep_s": args.sleep}
    for workers in (1, args.workers):
        seconds, metrics = stage(engine, tok, prompts, args.group_size, args.sleep, workers)
        result[f"stage_s_workers_{workers}"] = round(seconds, 3)
        result["env_steps"] = metrics["env/turns_mean"] * args.trajectories
    print(json.dumps(result))
    write_result(args.out, "multiturn_env_pool", result, args)


if __name__ == "__main__":
    main()
