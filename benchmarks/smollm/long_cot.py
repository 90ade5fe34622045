"""SmolLM2-135M on long worked answers at high staleness: grpo vs grpo-stale-relaxed vs mu-grpo, 2 seeds.

Issue 13 (the SmolLM2 part). One command per experiment::

    # 1. the task probe: response lengths and pass@1 of the untrained model on held-out prompts
    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks smollm_long_cot probe
    # 2. the comparison: every preset x seed, one after the other, results written after each run
    PYTHONPATH=. nohup nice -n 5 .venv-vllm/bin/python -m benchmarks smollm_long_cot run > long_cot.log 2>&1 &
    # 3. the table and the figure again from the stored results (no training)
    PYTHONPATH=. .venv/bin/python -m benchmarks smollm_long_cot report

The task: reasoning-gym ``basic_arithmetic`` (2 terms, 1 digit, + and -, the default job's
difficulty) with a step-by-step instruction and one worked chat demonstration, so the model writes a
worked answer of ~100 tokens whose decisive tokens (the result in step 3) come in the middle and are
followed by many ordinary ones (a check by the inverse operation, a restatement, the closing
sentence with the box). Harder variants (3-4 terms) were probed first: SmolLM2-135M (4-bit) then
almost never answers correctly at temperature 1, so groups have no reward variance.

Each run is ``mugrpo train`` in its own process (one command per run, printed into the results),
on the vLLM engine; the trainer's own evaluation (greedy, held-out items, ``eval.every_updates``)
gives the held-out accuracy, and ``metrics.jsonl`` gives the per-update diagnostics against the
update's position in its stage and the per-stage rollout timings. Output:
``benchmarks/results/smollm_long_cot.json`` (rewritten after every run, so a partial run still
reports), ``smollm_long_cot.png``; run directories under ``benchmarks/cache/smollm_long_cot/``.
Benchmarks report; they never assert on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.suite import RESULTS, ROOT, common_arguments, machine, read_figures, read_result, write_result

WORK = ROOT / "benchmarks" / "cache" / "smollm_long_cot"
OUT = RESULTS / "smollm_long_cot.json"

INSTRUCTION = "Solve it step by step, then check your result. Put your final answer within \\boxed{}."
FEW_SHOT = [{"question": "Calculate 8 + 5.",
             "answer": ("Let's solve this step by step.\n"
                        "Step 1: Read the problem. We need to compute 8 + 5.\n"
                        "Step 2: Start from the first number, 8.\n"
                        "Step 3: Apply the operation with the second number, 5: 8 + 5 = 13.\n"
                        "Step 4: Check the result by undoing the operation: 13 - 5 = 8, which is the first "
                        "number, so the result is right.\n"
                        "So the result of 8 + 5 is 13.\n"
                        "The final answer is \\boxed{13}.")}]
TASK_PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
               "allow_negation": False, "allow_parentheses": False}
PRESETS = ("grpo", "mu-grpo", "grpo-stale-relaxed")
"""Run order within a seed: the reference first, then the method, then the diagnostic."""


@dataclass
class Sizing:
    """One experiment's budget; every preset and seed gets the same one."""

    updates: int = 64
    stale_mu: int = 64
    """Updates per stage of the stale presets (grpo: 4)."""
    prompts_per_update: int = 1
    group_size: int = 4
    passes: int = 4
    """Optimizer passes over each stage's data (prompts_per_stage = mu x prompts_per_update / passes),
    the same for every preset, so every run generates the same number of sequences."""
    max_new_tokens: int = 192
    temperature: float = 0.7
    """Sampling temperature of the rollouts (the trainer's log-probs use the same); evaluation is greedy.
    At 1.0 the model rambles on this prompt (probe: 31% of responses hit 192 tokens, pass@1 0.05)."""
    lr: float = 2e-5
    eval_items: int = 32
    eval_every: int = 64
    threads: int = 1
    """torch threads (the in-process vLLM engine computes with them too). On a machine shared with
    other jobs one thread beat two: OpenMP threads wait for each other at every barrier, and one of
    them is often descheduled."""
    seeds: tuple = (0, 1)


def task_overrides() -> list[str]:
    return ["task.name=basic_arithmetic", f"task.params={json.dumps(TASK_PARAMS)}",
            f"task.instruction={json.dumps(INSTRUCTION)}", f"task.few_shot={json.dumps(FEW_SHOT)}",
            "task.size=2000", "task.eval_size=200"]


def run_overrides(preset: str, seed: int, z: Sizing, first: bool) -> list[str]:
    mu = 4 if preset == "grpo" else z.stale_mu
    return task_overrides() + [
        f"schedule.total_updates={z.updates}", f"schedule.updates_per_stage={mu}", "schedule.num_stages=null",
        f"schedule.prompts_per_update={z.prompts_per_update}",
        f"rollout.prompts_per_stage={mu * z.prompts_per_update // z.passes}",
        f"rollout.group_size={z.group_size}", f"rollout.max_new_tokens={z.max_new_tokens}",
        f"rollout.temperature={z.temperature}",
        "rollout.engine=vllm", f"optim.lr={z.lr}", f"train.seed={seed}", f"train.threads={z.threads}",
        "train.progress=false", "train.save_final_model=false", "train.save_stage_text=true", "checkpoint.keep_last=1",
        f"eval.num_items={z.eval_items}", f"eval.every_updates={z.eval_every}", "eval.every_stages=0",
        # The initial policy's greedy evaluation is the same model for every run: done once.
        f"eval.at_start={'true' if first else 'false'}", "eval.greedy=true", "eval.num_samples=0",
    ]


def command(preset: str, seed: int, z: Sizing, first: bool) -> list[str]:
    run_dir = WORK / f"{preset}-seed{seed}"
    return [".venv-vllm/bin/python", "-m", "mugrpo", "train", "--preset", preset, "--run-dir",
            str(run_dir.relative_to(ROOT)), *run_overrides(preset, seed, z, first)]


# ------------------------------------------------------------------------------------------------
# The probe: the untrained model on the task.


def probe(args) -> dict:
    import torch

    from mugrpo.config import load_config
    from mugrpo.rollout.engines import SamplingConfig, make_engine
    from mugrpo.models.loading import load_tokenizer, resolve_model_path
    from mugrpo.rollout.tasks import build_task, prompt_ids

    torch.set_num_threads(1)
    cfg = load_config("mu-grpo", overrides=task_overrides() + ["rollout.engine=vllm", "rollout.dtype=bfloat16"])
    path = resolve_model_path(cfg.model.name, cfg.model.cache_dir)
    tokenizer = load_tokenizer(path)
    task = build_task(cfg.task)
    items = task.eval_items[:args.prompts]
    prompts = [prompt_ids(tokenizer, item.question, cfg.task) for item in items]
    engine = make_engine("vllm", path, tokenizer, cfg.rollout, seed=0)
    t0 = time.perf_counter()
    sampling = SamplingConfig(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=1)
    groups = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    engine.close()
    flat = [c for g in groups for c in g]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat]
    scores, _ = task.score_all(texts, [item for item in items for _ in range(args.n)])
    per_item = scores.view(len(items), args.n)
    lengths = sorted(len(c.token_ids) for c in flat)
    result = {
        "task_params": TASK_PARAMS, "temperature": args.temperature, "num_prompts": len(items),
        "samples_per_prompt": args.n,
        "prompt_tokens": len(prompts[0]), "pass1": float(scores.mean()),
        "mixed_group_frac": float((per_item.max(1).values > per_item.min(1).values).float().mean()),
        "response_len": {"median": statistics.median(lengths), "mean": sum(lengths) / len(lengths),
                         "p10": lengths[len(lengths) // 10], "p90": lengths[9 * len(lengths) // 10],
                         "max": lengths[-1]},
        "truncated_frac": sum(c.finish_reason != "stop" for c in flat) / len(flat),
        "generate_s": seconds, "generate_tok_s": sum(lengths) / seconds,
        "example": texts[0],
    }
    write_result(args.out or RESULTS / f"smollm_long_cot_probe_T{args.temperature:g}.json", "smollm_long_cot",
                 result, args)
    print(json.dumps({k: v for k, v in result.items() if k != "example"}, indent=1))
    print(result["example"])
    return result


# ------------------------------------------------------------------------------------------------
# The comparison.

DIAG_KEYS = ("loss/ratio_mean_neg", "loss/ratio_mean_pos", "loss/veto_token_frac", "loss/veto_seq_frac",
             "loss/trigger_frac",
             "loss/first_trigger_pos", "loss/kl_behavior", "loss/clip_frac_low", "loss/clip_frac_high",
             "reward/mean", "perf/update_s")
STAGE_KEYS = ("reward/mean", "stage/response_len_mean", "stage/truncated_frac", "stage/zero_var_group_frac",
              "stage/num_sequences", "perf/sync_s", "perf/generate_s", "perf/generate_tok_s", "perf/score_s",
              "perf/optimize_s", "perf/eval_s", "perf/checkpoint_s", "stage/engine_logprob_mismatch")


def response_lengths(run_dir: Path) -> dict:
    """Token lengths and rewards of every generated response, from the stages' rollouts.jsonl: the length
    distribution over the run, and stage 0 alone (the untrained model: the task probe of a stale run)."""
    rows = {p.parent.name: [{**json.loads(line), "stage": p.parent.name} for line in p.read_text().splitlines() if line]
            for p in sorted(Path(run_dir).glob("stages/*/rollouts.jsonl"))}

    def dist(rs: list[dict]) -> dict | None:
        if not rs:
            return None
        lengths = sorted(r["num_tokens"] for r in rs)
        groups: dict = {}
        for r in rs:
            groups.setdefault((r["stage"], r["group"]), []).append(r["reward"])
        return {"num_responses": len(lengths), "median": statistics.median(lengths), "p10": lengths[len(lengths) // 10],
                "p90": lengths[9 * len(lengths) // 10], "max": lengths[-1],
                "truncated_frac": sum(not r["finished"] for r in rs) / len(rs),
                "reward_mean": sum(r["reward"] for r in rs) / len(rs),
                "mixed_group_frac": sum(max(g) > min(g) for g in groups.values()) / len(groups)}

    first = rows.get("stage_000", [])
    return {"all_stages": dist([r for rs in rows.values() for r in rs]), "stage_0": dist(first)}


def summarize_run(run_dir: Path) -> dict:
    """What the report needs from one run directory's metrics.jsonl."""
    from mugrpo.observability.loggers import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    updates = [{"update": r["update"], "update_in_stage": r["update_in_stage"],
                **{k: r.get(k) for k in DIAG_KEYS}} for r in records if r["kind"] == "update"]
    stages = [{"stage": r["stage"], **{k: r.get(k) for k in STAGE_KEYS}} for r in records if r["kind"] == "stage"]
    evals = [{"update": r["update"], "greedy_acc": r.get("eval/greedy_acc"),
              "response_len_mean": r.get("eval/response_len_mean"), "eval_s": r.get("perf/eval_s")}
             for r in records if r["kind"] == "eval"]
    gen_tok = sum((s["perf/generate_tok_s"] or 0) * (s["perf/generate_s"] or 0) for s in stages)
    gen_s = sum(s["perf/generate_s"] or 0 for s in stages)
    opt_s = sum(s["perf/optimize_s"] or 0 for s in stages)
    return {"updates": updates, "stages": stages, "evals": evals, "responses": response_lengths(run_dir),
            "totals": {"num_updates": len(updates), "num_stages": len(stages), "generate_s": gen_s,
                       "generated_tokens": gen_tok, "s_per_generated_token": gen_s / gen_tok if gen_tok else None,
                       "sync_s": sum(s["perf/sync_s"] or 0 for s in stages),
                       "sync_s_per_refresh": (sum(s["perf/sync_s"] or 0 for s in stages) / len(stages)
                                              if stages else None),
                       "optimize_s": opt_s, "optimize_s_per_update": opt_s / len(updates) if updates else None,
                       "eval_s": sum(s["perf/eval_s"] or 0 for s in stages)}}


def run(args) -> dict:
    z = Sizing(updates=args.updates, stale_mu=args.stale_mu, prompts_per_update=args.prompts_per_update,
               group_size=args.group_size, passes=args.passes, max_new_tokens=args.max_new_tokens, lr=args.lr,
               temperature=args.temperature,
               eval_items=args.eval_items, eval_every=args.eval_every, threads=args.threads, seeds=tuple(args.seeds))
    out = Path(args.out)
    result = read_figures(out) if args.keep and out.is_file() else {}
    result.update({"benchmark": "smollm_long_cot", "sizing": asdict(z),
                   "task": {"params": TASK_PARAMS, "instruction": INSTRUCTION, "few_shot": FEW_SHOT}})
    result.setdefault("runs", {})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = True
    for seed in z.seeds:
        for preset in args.presets:
            name = f"{preset}/seed{seed}"
            if name in result["runs"] and result["runs"][name].get("complete"):
                first = False
                continue
            cmd = command(preset, seed, z, first)
            run_dir = ROOT / cmd[cmd.index("--run-dir") + 1]
            if run_dir.exists():
                import shutil
                shutil.rmtree(run_dir)
            print(f"[long_cot] {name}: {shlex.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            with open(WORK / f"{preset}-seed{seed}.log", "w") as log:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            wall = time.perf_counter() - t0
            entry = {"preset": preset, "seed": seed, "command": shlex.join(cmd), "returncode": rc, "wall_s": wall,
                     "loadavg_end": os.getloadavg(), "complete": False}
            if (run_dir / "metrics.jsonl").is_file():
                entry.update(summarize_run(run_dir))
                entry["complete"] = rc == 0 and entry["totals"]["num_updates"] == z.updates
            result["runs"][name] = entry
            first = first and not entry.get("evals")
            result["summary"] = summarize(result)
            write_result(out, "smollm_long_cot", result, args, finished=False)
            print(f"[long_cot] {name}: rc {rc}, {wall:.0f} s; {json.dumps(result['summary'].get(name, {}))}",
                  flush=True)
    write_result(out, "smollm_long_cot", result, args)
    plot(result, out.with_suffix(".png"), read_result(out)["machine"]["cpu_capability"])
    return result


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def position_bins(updates: list[dict], key: str, mu: int, bins: int = 4) -> list[float | None]:
    """Mean of ``key`` over the updates in each quarter (``bins``) of their stage."""
    width = max(1, mu // bins)
    return [_mean(u[key] for u in updates if min(u["update_in_stage"] // width, bins - 1) == b) for b in range(bins)]


def rollout_ratio(runs: dict) -> dict:
    """Seconds per generated token, stale stage vs grpo's refreshes, and sync seconds per refresh, per seed.

    Both presets ran in the same benchmark process one after the other on the same machine; the ratio
    is only as good as the machine's load was steady between them (loadavg is in each run's entry).
    """
    out = {}
    for name, r in runs.items():
        if r["preset"] == "grpo" or not r.get("totals", {}).get("s_per_generated_token"):
            continue
        ref = runs.get(f"grpo/seed{r['seed']}", {}).get("totals", {})
        if ref.get("s_per_generated_token"):
            out[name] = {"s_per_token": r["totals"]["s_per_generated_token"],
                         "grpo_s_per_token": ref["s_per_generated_token"],
                         "grpo_over_stale": ref["s_per_generated_token"] / r["totals"]["s_per_generated_token"],
                         "sync_s_per_refresh": r["totals"]["sync_s_per_refresh"],
                         "grpo_sync_s_per_refresh": ref["sync_s_per_refresh"],
                         "grpo_num_refreshes": ref["num_stages"], "num_refreshes": r["totals"]["num_stages"],
                         "generate_s": r["totals"]["generate_s"], "grpo_generate_s": ref["generate_s"]}
    return out


def summarize(result: dict) -> dict:
    """Per run: held-out accuracy, the drift diagnostics by quarter of the stage, costs."""
    z = result["sizing"]
    out = {}
    for name, r in result["runs"].items():
        if not r.get("updates"):
            out[name] = {"complete": False, "returncode": r["returncode"]}
            continue
        mu = 4 if r["preset"] == "grpo" else z["stale_mu"]
        ups = r["updates"]
        out[name] = {
            "complete": r["complete"],
            "eval_greedy_acc": {e["update"]: e["greedy_acc"] for e in r["evals"]},
            "rho_neg_by_quarter": position_bins(ups, "loss/ratio_mean_neg", mu),
            "rho_pos_by_quarter": position_bins(ups, "loss/ratio_mean_pos", mu),
            "kl_behavior_by_quarter": position_bins(ups, "loss/kl_behavior", mu),
            "veto_token_frac_mean": _mean(u["loss/veto_token_frac"] for u in ups),
            "veto_token_frac_last_quarter": position_bins(ups, "loss/veto_token_frac", mu)[-1],
            "first_trigger_pos_mean": _mean(u["loss/first_trigger_pos"] for u in ups),
            # Triggers (rho < delta in an A < 0 response) are detected whatever the scope: for grpo-stale-relaxed
            # they are the tokens mu-grpo's veto would have started from.
            "trigger_frac_by_quarter": position_bins(ups, "loss/trigger_frac", mu),
            "train_reward_by_stage": [s["reward/mean"] for s in r["stages"]],
            "response_len_mean_by_stage": [s["stage/response_len_mean"] for s in r["stages"]],
            "responses": r.get("responses"),
            "optimize_s_per_update": r["totals"]["optimize_s_per_update"],
            "s_per_generated_token": r["totals"]["s_per_generated_token"],
            "wall_s": r["wall_s"],
        }
    out["rollout_phase"] = rollout_ratio(result["runs"])
    return out


def plot(result: dict, path: Path, cap: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "black", "grpo-stale-relaxed": "tab:red", "mu-grpo": "tab:blue"}
    keys = (("loss/ratio_mean_neg", "E[rho | A<0]"), ("loss/veto_token_frac", "vetoed token fraction"),
            ("loss/kl_behavior", "KL(pi_b || pi_theta), k3"))
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(17, 3.8))
    for name, r in result["runs"].items():
        if not r.get("updates"):
            continue
        style = "-" if r["seed"] == result["sizing"]["seeds"][0] else "--"
        for ax, (key, title) in zip(axes, keys):
            pts = [(u["update_in_stage"], u[key]) for u in r["updates"] if u[key] is not None]
            if r["preset"] == "grpo":  # mu = 4: the mean at each position, drawn at its staleness
                pts = [(p, _mean(v for q, v in pts if q == p)) for p in sorted({q for q, _ in pts})]
            else:
                pts = [p for p in pts if not math.isnan(p[1])]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors.get(r["preset"]), lw=1,
                    marker="o" if r["preset"] == "grpo" else None, label=name)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("update's position in its stage (staleness)")
        ev = [(e["update"], e["greedy_acc"]) for e in r["evals"]]
        first = result["runs"].get(next(iter(result["runs"])), {}).get("evals", [])
        if ev and ev[0][0] != 0 and first and first[0]["update"] == 0:
            ev = [(0, first[0]["greedy_acc"])] + ev  # the shared initial evaluation
        axes[-1].plot([e[0] for e in ev], [e[1] for e in ev], style, marker="o", color=colors.get(r["preset"]),
                      label=name)
    axes[-1].set_title("held-out greedy accuracy", fontsize=9)
    axes[-1].set_xlabel("optimizer update")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    z = result["sizing"]
    fig.suptitle(f"SmolLM2-135M, long worked answers: {z['updates']} updates x {z['prompts_per_update']}x"
                 f"{z['group_size']} seqs, stale mu = {z['stale_mu']}, lr {z['lr']:g}, CPU {cap}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(args) -> dict:
    parts = [read_result(p) for p in args.parts if Path(p).is_file()]
    if not parts:  # no driver finished a run: everything comes from the run directories
        parts = [{"figures": {"benchmark": "smollm_long_cot", "sizing": asdict(Sizing()), "runs": {},
                              "task": {"params": TASK_PARAMS, "instruction": INSTRUCTION, "few_shot": FEW_SHOT}},
                  "command": None, "machine": machine()}]
    result = parts[0]["figures"]
    cap = parts[0]["machine"]["cpu_capability"]  # the drivers' machine (the report's own is in its envelope)
    for part in parts[1:]:  # several drivers (e.g. one per seed): their runs side by side
        result["runs"].update(part["figures"]["runs"])
        result["sizing"]["seeds"] = sorted(set(result["sizing"]["seeds"]) | set(part["figures"]["sizing"]["seeds"]))
    if len(parts) > 1:
        result["driver_commands"] = [p["command"] for p in parts]
    z = Sizing(**{**result["sizing"], "seeds": tuple(result["sizing"]["seeds"])})
    for run_dir in sorted(WORK.glob("*-seed*/metrics.jsonl")):  # runs whose driver was stopped before they ended
        preset, seed = run_dir.parent.name.rsplit("-seed", 1)
        if preset in PRESETS and f"{preset}/seed{seed}" not in result["runs"]:
            result["runs"][f"{preset}/seed{seed}"] = {
                "preset": preset, "seed": int(seed), "command": shlex.join(command(preset, int(seed), z, True)),
                "returncode": None, "wall_s": None, "complete": False,
                "note": "its driver was stopped; the mugrpo train process ran on and was read from its run directory"}
    for entry in result["runs"].values():  # the run directories, where they are still there
        run_dir = WORK / f"{entry['preset']}-seed{entry['seed']}"
        if (run_dir / "metrics.jsonl").is_file():
            entry.update(summarize_run(run_dir))
            if entry["returncode"] is None:
                entry["complete"] = entry["totals"]["num_updates"] == z.updates
    result["summary"] = summarize(result)
    write_result(OUT, "smollm_long_cot", result, args)
    plot(result, OUT.with_suffix(".png"), cap)
    print(json.dumps(result["summary"], indent=1))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("probe", help="the untrained model on the task: lengths and pass@1")
    p.add_argument("--prompts", type=int, default=24, help="the first N held-out items")
    p.add_argument("--n", type=int, default=4, help="samples per item")
    p.add_argument("--max-new-tokens", type=int, default=Sizing.max_new_tokens)
    p.add_argument("--temperature", type=float, default=Sizing.temperature)
    common_arguments(p, "smollm_long_cot")
    p.set_defaults(out=None)  # benchmarks/results/smollm_long_cot_probe_T<temperature>.json
    r = sub.add_parser("run", help="every preset x seed, results written after each run")
    for f, v in asdict(Sizing()).items():
        if f != "seeds":
            r.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    common_arguments(r, "smollm_long_cot", seeds=list(Sizing().seeds))
    r.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    r.add_argument("--keep", action="store_true", help="keep the complete runs already in the results JSON")
    rep = sub.add_parser("report", help="summary and figure again from the stored results (and the run directories)")
    rep.add_argument("parts", nargs="*", default=[str(OUT)],
                     help="results JSONs to merge (e.g. one per seed), into benchmarks/results/smollm_long_cot.json")
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    {"probe": probe, "run": run, "report": report}[args.verb](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
