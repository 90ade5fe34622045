"""LoRA against full fine-tuning on SmolLM2-135M: seconds per optimizer update, peak memory, sync cost.

    PYTHONPATH=. OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks lora     # ~3 min on 2 quiet cores

One command runs every variant, each in a fresh subprocess (so each peak resident set is its own),
alternating full and LoRA, and writes ``benchmarks/results/lora.json`` with the CPU capability and
load average beside the numbers. docs/BENCHMARKS.md section 6 reads it. Compare the ratios taken
within this one run: the machine may be shared, so absolute seconds drift between runs.

Each variant: load the model, apply ``lora.*`` (or not), build the trainer's AdamW
(:func:`mugrpo.training.trainer.build_optimizer`), then run ``--updates`` real optimizer updates
(:meth:`mugrpo.training.trainer.Trainer.update`) on one synthetic stage of ``--prompts`` prompts x G = 8
responses (prompts of 96 tokens, about the default task's few-shot prompt; responses of 16-48
tokens; every advantage non-zero, so every sequence is trained). The first update allocates AdamW's state and is
reported apart; ``s_per_update`` is the mean of the others. Also timed: one engine sync's worth of
weights (``full_state_items``: the merged weights under LoRA) and one checkpoint's trained tensors.

Benchmarks report; they never assert on time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.suite import common_arguments, write_result

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"full": [], "lora_r16": ["lora.rank=16", "lora.alpha=32"]}


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def synthetic_stage(vocab: int, P: int, seed: int = 0):
    from mugrpo.stages.data import StageData

    gen = torch.Generator().manual_seed(seed)
    G = 8
    prompts = [torch.randint(10, vocab, (96,), generator=gen).tolist() for _ in range(P)]
    lengths = torch.randint(16, 49, (P * G,), generator=gen).tolist()
    responses = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]
    behavior = [(-torch.rand(n, generator=gen) * 2).tolist() for n in lengths]
    adv = torch.randn(P * G, generator=gen)
    return StageData(prompts, responses, behavior, torch.zeros(P * G), adv, torch.ones(P * G, dtype=torch.bool),
                     list(range(P)), G)


def one_variant(overrides: list[str], updates: int, prompts: int) -> dict:
    """Runs in the subprocess: everything measured for one configuration."""
    from mugrpo.kit import distributed as dist
    from mugrpo.models import lora
    from mugrpo.config import load_config
    from mugrpo.kit.distributed import World
    from mugrpo.hardware import detect, resolve
    from mugrpo.models.loading import load_policy, resolve_model_path
    from mugrpo.config.plan import make_plan
    from mugrpo.stages.state import RLState
    from mugrpo.training.trainer import Trainer, build_optimizer

    cfg = load_config("mu-grpo", overrides=["schedule.total_updates=8", "schedule.num_stages=1",
                                            f"schedule.prompts_per_update={prompts}", *overrides])
    torch.manual_seed(0)
    policy = lora.apply_lora(load_policy(resolve_model_path(cfg.model.name)), cfg.lora)
    policy.train()
    rss_model_kb = _status_kb("VmRSS")
    plan = make_plan(cfg)
    optimizer, scheduler = build_optimizer(policy, cfg, plan)
    resolved = resolve(cfg.train.autocast, "auto", "hf", detect())
    data = synthetic_stage(policy.config.vocab_size, prompts)
    seconds = []
    for u in range(updates):
        t0 = time.perf_counter()
        Trainer(cfg, plan, World(), policy, optimizer, scheduler, resolved=resolved,
                state=RLState(stage=0, update_in_stage=u % 8)).update(data)
        seconds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    synced = sum(t.numel() for _, t in dist.full_state_items(policy))
    sync_s = time.perf_counter() - t0
    trained = dict(dist.trained_items(policy))
    optim_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor))
    return {
        "overrides": overrides, "autocast": resolved.autocast, "updates": updates,
        "first_update_s": seconds[0], "s_per_update": sum(seconds[1:]) / max(1, len(seconds) - 1),
        "seconds": seconds,
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "optimizer_state_mb": optim_bytes / 2**20,
        "checkpoint_tensors_mb": sum(t.numel() * t.element_size() for t in trained.values()) / 2**20,
        "sync_weights_s": sync_s, "synced_params": synced,
        "rss_after_load_gb": rss_model_kb / 2**20, "peak_rss_gb": _status_kb("VmHWM") / 2**20,
        "tokens_per_update": sum(len(r) for r in data.responses),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per update (x G = 8 responses)")
    p.add_argument("--autocast", default="none,bf16", help="comma list of train.autocast values")
    p.add_argument("--variant-json", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    common_arguments(p, "lora")
    args = p.parse_args(argv)
    if args.variant_json:
        print("RESULT " + json.dumps(one_variant(json.loads(args.variant_json), args.updates, args.prompts)), flush=True)
        return
    out = {"what": f"SmolLM2-135M-Instruct, mu-grpo loss, {args.prompts * 8} sequences per "
           f"update ({args.prompts} prompts of 96 tokens x 8 responses of 16-48 tokens, synthetic), AdamW, CPU",
           "runs": {}}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for autocast in args.autocast.split(","):
        for name, overrides in VARIANTS.items():
            spec = json.dumps([f"train.autocast={autocast}", *overrides])
            proc = subprocess.run([sys.executable, "-m", "benchmarks.lora", "--updates", str(args.updates), "--prompts", str(args.prompts),
                                   "--variant-json", spec], env=env, cwd=ROOT, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"[lora] {name} {autocast} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(lines[-1][len("RESULT "):])
            out["runs"][f"{name}_{autocast}"] = result
            print(f"[lora] {name:9s} autocast={autocast}: {result['s_per_update']:.2f} s/update, peak RSS "
                  f"{result['peak_rss_gb']:.2f} GB, {result['trainable_params']:,} trainable", flush=True)
        full, lora = out["runs"][f"full_{autocast}"], out["runs"][f"lora_r16_{autocast}"]
        out[f"ratios_{autocast}"] = {
            "s_per_update_lora_over_full": lora["s_per_update"] / full["s_per_update"],
            "peak_rss_lora_over_full": lora["peak_rss_gb"] / full["peak_rss_gb"],
            "training_rss_delta_lora_over_full": (lora["peak_rss_gb"] - lora["rss_after_load_gb"])
            / (full["peak_rss_gb"] - full["rss_after_load_gb"]),
        }
    from mugrpo.hardware import detect

    write_result(args.out, "lora", out, args, native_bf16=detect().native_bf16, threads=torch.get_num_threads())
    print(json.dumps({k: v for k, v in out.items() if k.startswith("ratios")}, indent=1))
    print(f"[lora] written {args.out}")


if __name__ == "__main__":
    main()
