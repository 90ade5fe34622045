"""GPU check of the FSDP2 training path: optimise-phase tokens/s, MFU and peak memory -> JSON.

STATUS: NOT YET RUN ON A GPU (the ``--remote`` path neither). Written for one prepared run on a lent
CUDA machine (an H200 with PyTorch 2.11 and no network); its ``--preset tiny --device cpu`` smoke
mode is what has run, on the CPU development machine, to check the script's own logic (with
``--remote-only`` too). Numbers from it mean nothing.

What it does, per variant (bf16 mixed precision; + activation checkpointing; + CPU offload):
build a ~0.5B Qwen2-style model from its config (random init, no download), shard it with
``mugrpo.kit.distributed.apply_fsdp`` exactly as the trainer does, then run the trainer's own
``Trainer.update`` for a few updates on a synthetic stage dataset (random tokens, responses of
random length, behaviour log-probs near the random-init model's, advantages +-1). It also times the
engine-sync gather (``full_state_items``, one full parameter at a time).

Launch (one GPU or several; the script makes a one-process group itself if not under torchrun)::

    python -m benchmarks gpu_fsdp_check --out $OUT/gpu_fsdp_check.json
    torchrun --standalone --nproc_per_node 8 benchmarks/gpu_fsdp_check.py --out results.json
    python -m benchmarks gpu_fsdp_check --preset tiny --device cpu --out /tmp/smoke.json   # CPU smoke
    python -m benchmarks gpu_fsdp_check --remote-only --out $OUT/remote.json   # the rollout-service path

MFU counts model FLOPs only (no recompute): per token 6 x (non-embedding parameters) for the
matmuls, + 6 x L x T x d for causal attention (QK^T and AV, fwd+bwd, half the T x T scores), and
6 x V x d for the LM head on response tokens only (the trainer keeps response logits only). Peak
is the dense bf16 peak given by ``--peak-tflops`` (989 for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.suite import common_arguments, write_result  # noqa: E402
from mugrpo.kit import distributed as dist  # noqa: E402
from mugrpo.stages import shards  # noqa: E402
from mugrpo.config import load_config  # noqa: E402
from mugrpo.stages.data import StageData
from mugrpo.config.plan import make_plan  # noqa: E402
from mugrpo.stages.state import RLState  # noqa: E402
from mugrpo.training.trainer import Trainer, build_optimizer  # noqa: E402

# Qwen2.5-0.5B's shape (494M parameters, tied embeddings); "tiny" is for the CPU smoke run.
PRESETS = {
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
VARIANTS = {
    "bf16": {"parallel.mixed_precision": "bf16"},
    "bf16+ac": {"parallel.mixed_precision": "bf16", "parallel.activation_checkpointing": True},
    "bf16+offload": {"parallel.mixed_precision": "bf16", "parallel.cpu_offload": True},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(p, "gpu_fsdp_check")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--prompts-per-update", type=int, default=16, help="prompt groups per update (all ranks)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-response-len", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--updates", type=int, default=3, help="timed updates per variant (after 1 warm-up)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU")
    p.add_argument("--remote", action="store_true",
                   help="also time the remote-engine path (rank 0): a mugrpo serve --engine hf service on this "
                        "machine's device, weight syncs through /dev/shm, one generate call (docs/SERVING.md)")
    p.add_argument("--remote-only", action="store_true", help="the remote path alone (no FSDP variants)")
    return p.parse_args(argv)


def init_group(device: str) -> dist.World:
    """torchrun's group, or a one-process group made here (FSDP2 needs a group even for one rank)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    tdist.init_process_group(backend="cuda:nccl,cpu:gloo" if device == "cuda" else "gloo")
    return dist.World(rank=tdist.get_rank(), size=tdist.get_world_size(), local_rank=local_rank)


def build_model(preset: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**PRESETS[preset], max_position_embeddings=32768, rope_theta=1_000_000.0,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config), config


def synthetic_stage(num_groups: int, args, vocab: int, rank: int) -> StageData:
    g = torch.Generator().manual_seed(1234 + rank)
    G = args.group_size
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(num_groups)]
    lengths = torch.randint(args.max_response_len // 4, args.max_response_len + 1, (num_groups * G,), generator=g)
    responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]
    # A random-init model puts ~1/V on every token: behaviour log-probs near -log V keep ratios ~1.
    behavior = [[-float(torch.log(torch.tensor(float(vocab))))] * len(r) for r in responses]
    advantages = torch.where(torch.rand(num_groups * G, generator=g) < 0.5, -1.0, 1.0)
    return StageData(prompts, responses, behavior, advantages.clone(), advantages, torch.ones(num_groups * G,
                     dtype=torch.bool), list(range(num_groups)), G)


def model_flops(config, data: StageData, seqs: list[int]) -> float:
    """Model FLOPs (fwd + bwd) of one update's sequences; see the module docstring."""
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * config.intermediate_size  # q, o; k, v; gate, up, down
    flops = 0.0
    for s in seqs:
        T = len(data.prompts[s // data.group_size]) + len(data.responses[s])
        flops += 6 * L * per_layer * T + 6 * L * d * T * T + 6 * V * d * len(data.responses[s])
    return flops


def run_variant(name: str, overrides: dict, args, world: dist.World) -> dict:
    device = torch.device(args.device, world.local_rank) if args.device == "cuda" else torch.device("cpu")
    P, G = args.prompts_per_update, args.group_size
    cfg = load_config(overrides=[f"{k}={json.dumps(v)}" for k, v in {
        **overrides, "schedule.total_updates": args.updates + 1, "schedule.updates_per_stage": args.updates + 1,
        "schedule.num_stages": None, "schedule.prompts_per_update": P, "rollout.group_size": G,
        "schedule.micro_batch_size": args.micro_batch_size, "rollout.max_new_tokens": args.max_response_len,
        "optim.lr": 1e-6, "train.progress": False}.items()])
    plan = make_plan(cfg, world.size)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, config = build_model(args.preset)
    num_params = sum(p.numel() for p in model.parameters())
    if cfg.parallel.activation_checkpointing:
        dist.apply_activation_checkpointing(model)
    dist.apply_fsdp(model, cfg.parallel)
    model.train()
    optimizer, scheduler = build_optimizer(model, cfg, plan)
    data = synthetic_stage(P // world.size * (args.updates + 1), args, config.vocab_size, world.rank)
    state = RLState()
    times, tokens, flops, losses = [], [], [], []
    for u in range(args.updates + 1):
        groups = shards.rank_update_groups(data, P // world.size, u, cfg.train.seed, 0)
        seqs = [g * G + j for g in groups for j in range(G)]
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = Trainer(cfg, plan, world, model, optimizer, scheduler, device=device, state=state).update(data)
        if args.device == "cuda":
            torch.cuda.synchronize()
        state.update_in_stage += 1
        if u == 0:
            continue  # warm-up: allocator, kernels, lazy FSDP init
        times.append(time.perf_counter() - t0)
        local = torch.tensor([sum(len(data.prompts[s // G]) + len(data.responses[s]) for s in seqs),
                              model_flops(config, data, seqs)], dtype=torch.float64)
        total = dist.sum_over_ranks(local)
        tokens.append(float(total[0]))
        flops.append(float(total[1]))
        losses.append(metrics["loss/total"])
    t_sync = time.perf_counter()
    for _ in dist.full_state_items(model, keep=False):
        pass
    if args.device == "cuda":
        torch.cuda.synchronize()
    sync_s = time.perf_counter() - t_sync
    out = {
        "variant": name, "overrides": overrides, "num_params": num_params, "world_size": world.size,
        "update_s": times, "tokens_per_update": tokens[0] if tokens else None,
        "optimize_tok_s": sum(tokens) / sum(times), "optimize_tok_s_per_gpu": sum(tokens) / sum(times) / world.size,
        "mfu": sum(flops) / sum(times) / world.size / (args.peak_tflops * 1e12),
        "losses": losses, "losses_finite": all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
        "grad_norm_last": metrics["optim/grad_norm"], "weight_gather_s": sync_s,
    }
    if args.device == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del model, optimizer, scheduler
    gc.collect()
    return out


def run_remote(args) -> dict:
    """The remote path, prepared for the first GPU run (NOT YET RUN ON A GPU): the preset's model (random
    init, bf16 on cuda) and a character tokenizer saved to a folder, served by ``mugrpo serve --engine hf``
    in a subprocess on the same device; the trainer side is a ``RemoteEngine``. Times: the service's start,
    three weight syncs (write to /dev/shm + load in the service), one generate call of
    ``--prompts-per-update`` prompts x ``--group-size`` samples x 128 new tokens."""
    import re
    import subprocess
    import tempfile

    from mugrpo.models.loading import load_tokenizer
    from mugrpo.models.tiny import build_char_tokenizer
    from mugrpo.rollout.engines import SamplingConfig, make_engine

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    folder = Path(tempfile.mkdtemp(prefix="mugrpo-remote-check-"))
    model, _ = build_model(args.preset)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mugrpo", "serve", "--engine", "hf", "--model", str(folder),
                             "--port", "0", "--dtype", dtype, "--batch-size", "1024"], stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        url = None
        for line in proc.stderr:
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        if url is None:
            raise RuntimeError("mugrpo serve did not start")
        start_s = time.perf_counter() - t0
        cfg = load_config(overrides=["rollout.engine=remote", f"rollout.remote.urls=[{url}]", f"rollout.dtype={dtype}",
                                     "rollout.batch_size=1024"])
        engine = make_engine("remote", str(folder), load_tokenizer(str(folder)), cfg.rollout)
        sync_s = []
        for _ in range(3):
            t = time.perf_counter()
            engine.load_weights(model.named_parameters())
            sync_s.append(time.perf_counter() - t)
        prompts = [[5 + (i + j) % 90 for j in range(args.prompt_len)] for i in range(args.prompts_per_update)]
        t = time.perf_counter()
        out = engine.generate(prompts, SamplingConfig(n=args.group_size, max_new_tokens=128, seed=0))
        generate_s = time.perf_counter() - t
        engine.close()
        new_tokens = sum(len(c.token_ids) for group in out for c in group)
        return {"service_start_s": start_s, "weight_sync_s": sync_s, "generate_s": generate_s,
                "num_new_tokens": new_tokens, "generate_tok_s": new_tokens / generate_s,
                "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    world = init_group(args.device)
    results = {"status": "ran", "preset": args.preset, "device": args.device, "variants": []}
    gpu = {"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}
    names = [] if args.remote_only else args.variants.split(",")
    if (args.remote or args.remote_only) and world.is_main:
        t0 = time.perf_counter()
        try:
            results["remote"] = run_remote(args)
        except Exception as exc:  # noqa: BLE001 - record the failure, go on
            results["remote"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results["remote"]["wall_s"] = time.perf_counter() - t0
        print(json.dumps({k: v for k, v in results["remote"].items() if k != "traceback"}), flush=True)
        write_result(args.out, "gpu_fsdp_check", results, args, finished=not names, world_size=world.size, **gpu)
    for name in names:
        t0 = time.perf_counter()
        try:
            result = run_variant(name, VARIANTS[name], args, world)
        except Exception as exc:  # noqa: BLE001 - record the failure, go on with the next variant
            result = {"variant": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["wall_s"] = time.perf_counter() - t0
        results["variants"].append(result)
        if world.is_main:
            print(json.dumps({k: v for k, v in result.items() if k != "traceback"}), flush=True)
            write_result(args.out, "gpu_fsdp_check", results, args, finished=len(results["variants"]) == len(names),
                         world_size=world.size, **gpu)
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
