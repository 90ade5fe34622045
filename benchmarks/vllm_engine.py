"""Benchmark of the vLLM rollout engine (not a test: it writes numbers to files and asserts nothing).

Measures, on the default job (SmolLM2-135M-Instruct, the default task's prompts, the default
rollout settings):
- generation tokens/s for 64, 256 and 1024 sequences through mugrpo's ``VLLMEngine.generate`` and
  through a raw ``LLM.generate`` on the same prompts and sampling settings (no log-probs, no
  per-request seeds, no conversion), on the engine's own ``LLM``, interleaved size by size; then
  the same sizes on a separate ``LLM`` built with vLLM's default engine settings (chunked
  prefill on), to show what mugrpo's engine settings cost;
- engine start-up seconds (in-process and subprocess) and weight-sync seconds;
- the default job's first-stage generation through the HF engine and through the vLLM engine.

Run it with the vLLM environment (scripts/setup_vllm.sh):

    .venv-vllm/bin/python -m benchmarks vllm_engine

It writes benchmarks/results/vllm_engine.json and the results section of docs/VLLM.md. On a
shared CPU the absolute numbers are noisy: compare within one run, as ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.suite import common_arguments, write_result  # noqa: E402
from mugrpo.config import Config  # noqa: E402
from mugrpo.rollout.engines.base import SamplingConfig  # noqa: E402
from mugrpo.models.loading import load_policy, load_tokenizer, resolve_model_path  # noqa: E402
from mugrpo.config.plan import make_plan  # noqa: E402
from mugrpo.rollout.tasks import build_task, prompt_ids  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vllm_engine.json"
DOC = ROOT / "docs" / "VLLM.md"
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"


def job_config(dtype: str) -> Config:
    """The default config with the engines' dtype ``dtype``; ``auto`` (the config's default) resolved as
    training resolves it on this machine (the trainer's precision: bfloat16 under bf16 autocast, else
    float32), since the engines themselves take a concrete dtype (the HF engine had a KeyError on it)."""
    from mugrpo.hardware import detect, resolve

    cfg = Config()
    cfg.rollout.dtype = resolve(cfg.train.autocast, dtype, "hf", detect()).engine_dtype
    return cfg


def default_job(num_prompts: int, dtype: str):
    cfg = job_config(dtype)
    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    tokenizer = load_tokenizer(path)
    task = build_task(cfg.task)
    indices = task.sample(num_prompts, torch.Generator().manual_seed(0))
    prompts = [prompt_ids(tokenizer, task.items[i].question, cfg.task) for i in indices]
    r = cfg.rollout
    sampling = SamplingConfig(n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, seed=1)
    return cfg, path, tokenizer, prompts, sampling


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def timed_cpu(fn):
    """(result, wall seconds, CPU seconds of this process). In-process vLLM computes in this process,
    so CPU seconds measure its work even when other processes slow the wall clock down."""
    c0 = time.process_time()
    out, wall = timed(fn)
    return out, wall, time.process_time() - c0


def mugrpo_tokens(groups) -> int:
    return sum(len(c.token_ids) for g in groups for c in g)


def raw_tokens(outputs) -> int:
    return sum(len(o.token_ids) for out in outputs for o in out.outputs)


def bench_hf(cfg, path, tokenizer, prompts, sampling) -> dict:
    from mugrpo.rollout.engines.hf import HFEngine

    engine = HFEngine(path, tokenizer, cfg.rollout, device="cpu")
    out, seconds = timed(lambda: engine.generate(prompts, sampling))
    engine.close()
    return {"sequences": len(prompts) * sampling.n, "new_tokens": mugrpo_tokens(out), "seconds": seconds,
            "tok_s": mugrpo_tokens(out) / seconds}


def bench_subprocess(cfg, path, tokenizer, policy) -> dict:
    from mugrpo.rollout.engines.vllm import VLLMEngine

    cfg.rollout.vllm.in_process = False
    engine, startup = timed(lambda: VLLMEngine(path, tokenizer, cfg.rollout, seed=0))
    syncs = [timed(lambda: engine.load_weights(policy.named_parameters()))[1] for _ in range(3)]
    engine.close()
    cfg.rollout.vllm.in_process = True
    return {"startup_s": startup, "sync_s": statistics.median(syncs)}


def raw_llm(vllm, cfg, path):
    """vLLM as a user would build it: vLLM's defaults plus the same model, dtype and KV cache size."""
    r = cfg.rollout
    return vllm.LLM(model=path, dtype=r.dtype, seed=0, enforce_eager=r.vllm.enforce_eager,
                    max_model_len=r.vllm.max_model_len, kv_cache_memory_bytes=int(r.vllm.kv_cache_gb * 2**30))


def raw_generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def cold(llm):
    """Empty the prefix cache, as after a stage-start sync: otherwise whichever call runs second on
    the same prompts skips their prefill."""
    llm.reset_prefix_cache()


def bench_sizes(engine, sizes, repeats, prompts, sampling, raw_params) -> list[dict]:
    """Per size: raw ``LLM.generate`` on the engine's own ``LLM``, then ``VLLMEngine.generate``, alternated
    ``repeats`` times so that load changes on a shared machine hit both alike; the best of each counts
    (the run least disturbed by other processes)."""
    rows = []
    for size, reps in zip(sizes, repeats):
        batch = prompts[:size // sampling.n]
        raw_runs, our_runs = [], []
        for rep in range(reps):
            print(f"[bench] {size} sequences ({rep + 1}/{reps}): raw LLM.generate, then VLLMEngine.generate", flush=True)
            cold(engine.llm)
            raw_out, raw_s, raw_cpu = timed_cpu(lambda: raw_generate(engine.llm, batch, raw_params))
            cold(engine.llm)
            ours, ours_s, ours_cpu = timed_cpu(lambda: engine.generate(batch, sampling))
            raw_runs.append((raw_tokens(raw_out) / raw_s, raw_tokens(raw_out) / raw_cpu))
            our_runs.append((mugrpo_tokens(ours) / ours_s, mugrpo_tokens(ours) / ours_cpu))
            print(f"[bench]   raw {raw_runs[-1][0]:.0f} tok/s ({raw_runs[-1][1]:.0f} per CPU-s), "
                  f"mugrpo {our_runs[-1][0]:.0f} tok/s ({our_runs[-1][1]:.0f} per CPU-s)", flush=True)
        row = {"sequences": size, "raw_runs_tok_per_wall_s_cpu_s": raw_runs,
               "mugrpo_runs_tok_per_wall_s_cpu_s": our_runs,
               "raw_tok_s": max(r[0] for r in raw_runs), "mugrpo_tok_s": max(r[0] for r in our_runs),
               "raw_tok_cpu_s": max(r[1] for r in raw_runs), "mugrpo_tok_cpu_s": max(r[1] for r in our_runs)}
        row["ratio"] = row["mugrpo_tok_s"] / row["raw_tok_s"]
        row["ratio_cpu"] = row["mugrpo_tok_cpu_s"] / row["raw_tok_cpu_s"]
        rows.append(row)
    return rows


def bench_raw_defaults(vllm, cfg, path, sizes, prompts, raw_params) -> dict:
    """A separate ``LLM`` with vLLM's default engine settings (chunked prefill on), for the same sizes."""
    llm, startup = timed(lambda: raw_llm(vllm, cfg, path))
    raw_generate(llm, prompts[:4], raw_params)  # warm-up
    rows = []
    for size in sizes:
        cold(llm)
        out, seconds = timed(lambda: raw_generate(llm, prompts[:size // raw_params.n], raw_params))
        rows.append({"sequences": size, "tokens": raw_tokens(out), "seconds": seconds,
                     "tok_s": raw_tokens(out) / seconds})
        print(f"[bench]   vLLM defaults, {size} sequences: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    llm.llm_engine.engine_core.shutdown()  # one in-process engine at a time (see mugrpo/rollout/engines/vllm.py)
    return {"startup_s": startup, "throughput": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "vllm_engine")
    parser.set_defaults(out=None)  # benchmarks/results/vllm_engine{--tag}.json
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="sequences per generate call")
    parser.add_argument("--repeats", type=int, nargs="+", default=[3, 3, 1],
                        help="alternating raw/mugrpo repetitions per size (the last value repeats)")
    parser.add_argument("--tag", default="", help="suffix for the results file and the doc section")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch / OpenMP threads for every engine (default: torch's). On a shared machine "
                             "1 thread is far steadier: 2 OpenMP threads that lose a core to another process "
                             "spin at barriers and run several times slower")
    parser.add_argument("--dtype", default=Config().rollout.dtype, help="engine dtype (default: the config's, auto: resolved as training does)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the (slow) HF-engine comparison")
    parser.add_argument("--skip-subprocess", action="store_true", help="skip the subprocess-engine start-up/sync")
    parser.add_argument("--raw-defaults-sizes", type=int, nargs="*", default=None,
                        help="sizes for the separate vLLM-defaults engine (default: --sizes; none: skip it)")
    parser.add_argument("--job-prompts", type=int, default=None,
                        help="prompts of the default job's stage for the HF-vs-vLLM comparison (default: all)")
    args = parser.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM then keeps torch at this count
        torch.set_num_threads(args.threads)

    probe = Config()
    job_prompts = args.job_prompts or make_plan(probe).prompts_per_stage
    G = probe.rollout.group_size
    cfg, path, tokenizer, prompts, sampling = default_job(max(job_prompts, max(args.sizes) // G), args.dtype)
    if args.threads:  # the subprocess engine core binds its own threads
        cfg.rollout.vllm.cpu_threads_bind = ",".join(map(str, sorted(os.sched_getaffinity(0))[:args.threads]))
    results: dict = {"model": cfg.model.name, "dtype": cfg.rollout.dtype, "group_size": G, "argv": sys.argv[1:] if argv is None else argv,
                     "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                     "cpu_count": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                     "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "load_average_start": os.getloadavg()[0]}

    if not args.skip_hf:  # first, before vLLM binds this process's threads
        print(f"[bench] HF engine, default job: {job_prompts} prompts x {G}", flush=True)
        results["hf_default_job"] = bench_hf(cfg, path, tokenizer, prompts[:job_prompts], sampling)

    _, import_s = timed(lambda: __import__("vllm"))
    import vllm
    from vllm import SamplingParams

    from mugrpo.rollout.engines.vllm import VLLMEngine

    results.update(vllm=vllm.__version__, import_vllm_s=import_s)
    policy = load_policy(path)
    raw_params = SamplingParams(n=G, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_tokens=sampling.max_new_tokens)
    if not args.skip_subprocess:
        print("[bench] subprocess engine: start-up and sync", flush=True)
        results["subprocess"] = bench_subprocess(cfg, path, tokenizer, policy)

    print("[bench] in-process engine: start-up and sync", flush=True)
    engine, startup = timed(lambda: VLLMEngine(path, tokenizer, cfg.rollout, seed=0))
    syncs = [timed(lambda: engine.load_weights(policy.named_parameters()))[1] for _ in range(3)]
    results["in_process"] = {"startup_s": startup, "sync_s": statistics.median(syncs)}
    # Warm-up: first calls pay one-off costs (allocations, kernel selection).
    engine.generate(prompts[:4], sampling)
    raw_generate(engine.llm, prompts[:4], raw_params)
    repeats = (args.repeats + args.repeats[-1:] * len(args.sizes))[:len(args.sizes)]
    results["throughput"] = bench_sizes(engine, args.sizes, repeats, prompts, sampling, raw_params)
    print(f"[bench] vLLM engine, default job: {job_prompts} prompts x {G}", flush=True)
    cold(engine.llm)
    out, seconds = timed(lambda: engine.generate(prompts[:job_prompts], sampling))
    results["vllm_default_job"] = {"sequences": job_prompts * G, "new_tokens": mugrpo_tokens(out), "seconds": seconds,
                                   "tok_s": mugrpo_tokens(out) / seconds}
    engine.close()

    raw_sizes = args.sizes if args.raw_defaults_sizes is None else args.raw_defaults_sizes
    if raw_sizes:
        print("[bench] a separate LLM with vLLM's default engine settings", flush=True)
        results["raw_defaults"] = bench_raw_defaults(vllm, cfg, path, raw_sizes, prompts, raw_params)
    results["load_average_end"] = os.getloadavg()[0]

    # the figures keep the machine facts write_doc prints beside the table
    out = write_result(args.out or RESULTS.with_name(f"vllm_engine{args.tag}.json"), "vllm_engine", results, args,
                       indent=2)
    write_doc(results, args.tag)
    print(f"[bench] wrote {out} and {DOC.relative_to(ROOT)}")


def write_doc(res: dict, tag: str = "") -> None:
    """Replace the results section of docs/VLLM.md (between the benchmark markers)."""
    begin, end = BEGIN.replace("benchmark", f"benchmark{tag}"), END.replace("benchmark", f"benchmark{tag}")
    lines = [begin, "",
             f"Measured with vLLM {res['vllm']}, torch {res['torch']}, {res['threads']} thread(s) on "
             f"{res['cpu_count']} CPU cores, "
             f"{res['model']} in {res['dtype']}, n = {res['group_size']} samples per prompt, temperature "
             f"{res['temperature']:g}, up to {res['max_new_tokens']} new tokens (natural stop). Command: "
             f"`.venv-vllm/bin/python -m benchmarks vllm_engine {' '.join(res['argv'])}`. Load average (1 min) at start / end: "
             f"{res['load_average_start']:.1f} / {res['load_average_end']:.1f} (the machine is shared).", "",
             "Best of the alternated runs per size (all runs are in the JSON file).", "",
             "| sequences | raw `LLM.generate` tok/s | mugrpo `VLLMEngine.generate` tok/s | mugrpo / raw "
             "| tokens per CPU-second, raw / mugrpo | mugrpo / raw, CPU | separate `LLM` with vLLM's defaults, tok/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    defaults = {r["sequences"]: r["tok_s"] for r in res.get("raw_defaults", {}).get("throughput", [])}
    for row in res["throughput"]:
        d = f"{defaults[row['sequences']]:.0f}" if row["sequences"] in defaults else "-"
        lines.append(f"| {row['sequences']} | {row['raw_tok_s']:.0f} | {row['mugrpo_tok_s']:.0f} "
                     f"| {row['ratio']:.2f} | {row['raw_tok_cpu_s']:.0f} / {row['mugrpo_tok_cpu_s']:.0f} "
                     f"| {row['ratio_cpu']:.2f} | {d} |")
    ip = res["in_process"]
    lines += ["", "| | seconds |", "|---|---:|",
              f"| `import vllm` | {res['import_vllm_s']:.1f} |",
              f"| engine start-up, in-process (after the import) | {ip['startup_s']:.1f} |",
              f"| weight sync, in-process (median of 3) | {ip['sync_s']:.2f} |"]
    if "raw_defaults" in res:
        lines.append(f"| raw `LLM(...)` start-up with vLLM's defaults, in-process | {res['raw_defaults']['startup_s']:.1f} |")
    if "subprocess" in res:
        sp = res["subprocess"]
        lines += [f"| engine start-up, subprocess engine core | {sp['startup_s']:.1f} |",
                  f"| weight sync, subprocess (safetensors in /dev/shm, median of 3) | {sp['sync_s']:.2f} |"]
    if "hf_default_job" in res:
        hf, vl = res["hf_default_job"], res["vllm_default_job"]
        lines += ["", "The default job's stage generation (its first "
                  f"{hf['sequences'] // res['group_size']} prompts x {res['group_size']}, the same prompts and "
                  f"sampling settings, {res['dtype']} in both engines):", "",
                  "| engine | new tokens | seconds | new tok/s |", "|---|---:|---:|---:|",
                  f"| HF (`rollout.engine=hf`) | {hf['new_tokens']} | {hf['seconds']:.1f} | {hf['tok_s']:.0f} |",
                  f"| vLLM (`rollout.engine=vllm`) | {vl['new_tokens']} | {vl['seconds']:.1f} | {vl['tok_s']:.0f} |",
                  "", f"vLLM / HF generation time: {hf['seconds'] / vl['seconds']:.1f}x faster."]
    lines += ["", end]
    text = DOC.read_text() if DOC.is_file() else "# vLLM engine\n"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    DOC.write_text(head + "\n".join(lines) + tail)


if __name__ == "__main__":  # vLLM may start engine-core subprocesses: never run this on import
    main()
