"""One client side of :mod:`benchmarks.serving`'s ``stage`` measurement, run as a script under the tree being
measured (``PYTHONPATH=TREE python benchmarks/serving_client.py ...``), so the same script drives an earlier
commit's ``RemoteEngine`` against its own service and this tree's against vLLM's server.

It builds one stage of the default task (``--prompts`` prompts x ``--group-size`` samples, the default
config's sampling), and optionally an evaluation call (``--eval-items`` held-out prompts, greedy) started at
the same moment from a second engine, as a second trainer rank or an evaluation would share the service.
It prints one JSON line: seconds and new tokens per call, the stage's tokens per second, and the time until
both calls were answered. It asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time


def _engine(model_path: str, tokenizer, cfg):
    from mugrpo.rollout.engines import make_engine

    return make_engine("remote", model_path, tokenizer, cfg.rollout)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-items", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    import torch

    from mugrpo.api import make_config
    from mugrpo.models.loading import load_tokenizer, resolve_model_path
    from mugrpo.rollout.engines.base import SamplingConfig
    from mugrpo.rollout.tasks import build_task, prompt_ids

    cfg = make_config({"rollout.engine": "remote", "rollout.remote.urls": [args.url], "rollout.dtype": args.dtype,
                       "rollout.remote.timeout_s": 120.0})
    path = resolve_model_path(cfg.model.name, os.environ.get("MUGRPO_CACHE", "~/.cache/mugrpo"))
    tokenizer = load_tokenizer(path)
    task = build_task(cfg.task)
    picks = task.sample(args.prompts, torch.Generator().manual_seed(args.seed))
    stage_prompts = [prompt_ids(tokenizer, task.items[i].prompt, cfg.task) for i in picks]
    stage_sampling = SamplingConfig(n=args.group_size, temperature=cfg.rollout.temperature,
                                    max_new_tokens=cfg.rollout.max_new_tokens, seed=args.seed)
    calls = {"stage": (stage_prompts, stage_sampling)}
    if args.eval_items:
        eval_prompts = [prompt_ids(tokenizer, it.prompt, cfg.task) for it in task.eval_items[:args.eval_items]]
        calls["eval"] = (eval_prompts, dataclasses.replace(stage_sampling, n=1, temperature=0.0))
    engines = {name: _engine(path, tokenizer, cfg) for name in calls}
    results, t0 = {}, time.perf_counter()

    def run(name: str) -> None:
        prompts, sampling = calls[name]
        start = time.perf_counter()
        out = engines[name].generate(prompts, sampling)
        results[name] = {"s": time.perf_counter() - start, "done_at_s": time.perf_counter() - t0,
                         "sequences": sum(len(g) for g in out),
                         "new_tokens": sum(len(c.token_ids) for g in out for c in g)}

    threads = [threading.Thread(target=run, args=(name,)) for name in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for engine in engines.values():
        engine.close()
    stage = results["stage"]
    print(json.dumps({**{f"{k}_{name}": v for name, r in results.items() for k, v in r.items()},
                      "stage_tokens_per_s": stage["new_tokens"] / stage["s"],
                      "all_done_s": max(r["done_at_s"] for r in results.values())}), flush=True)


if __name__ == "__main__":
    main()
