"""SmolLM2-135M: the off-policy corrections side by side on identical stale rollouts (issue 21 part 4).

    # one driver per seed (each one torch thread); results rewritten after every run, finished runs skipped
    PYTHONPATH=. OMP_NUM_THREADS=1 nohup .venv-vllm/bin/python -m benchmarks smollm_corrections run --seeds 0 \
        --out benchmarks/results/smollm_corrections_s0.json > corrections_s0.log 2>&1 &
    # merge the parts, write the summary, the table and the figure (or redraw them from the committed results:
    # report benchmarks/results/smollm_corrections.json)
    PYTHONPATH=. .venv/bin/python -m benchmarks smollm_corrections report benchmarks/results/smollm_corrections_s*.json

Setting: the long worked answers of docs/BENCHMARKS.md section 2b (:mod:`benchmarks.smollm.long_cot`:
reasoning-gym ``basic_arithmetic`` with a step-by-step instruction and one worked demonstration, ~110-token
answers at temperature 0.7, 64 updates of 1 prompt x G = 4, 4 passes over the stage), as one stage of
mu = 64 updates, at two learning rates (``--lrs``): 2e-5 (S x lr = 1.3e-3, about the paper's 1024 x 1e-6)
and 6e-5 (3.8x the paper's).

Per seed, the first run (IcePop at the first lr: it needs the trainer's recomputed behaviour log-probs,
so its stage data carries both the engine's and the trainer's) generates stage 0 on vLLM and is kept;
every other run of the seed replays it (``mugrpo train --replay``): the same 64 responses, behaviour
log-probs and advantages, so the methods differ only in their updates. Stage 0 is sampled from the
untrained model and does not depend on the lr, so one source serves both lrs. The methods and their
parameters are those of the toy lab's comparison (:data:`benchmarks.corrections_grid.METHODS`),
all on top of grpo-stale-relaxed except mu-grpo and m2po (their presets).

Held-out: greedy on the first ``--eval-items`` held-out items, before training (the source run only:
the initial policy is the same model for every run) and after the last update. Each run is one
``mugrpo train`` process whose command is stored beside its numbers. Benchmarks report; they never
assert on time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.corrections_grid import METHODS as GRID, SOURCE
from benchmarks.smollm.long_cot import ROOT, RESULTS, Sizing, position_bins, run_overrides, summarize_run
from benchmarks.suite import common_arguments, read_figures, read_result, write_result

WORK = ROOT / "benchmarks" / "cache" / "smollm_corrections"
OUT = RESULTS / "smollm_corrections.json"
METHODS = {k: v for k, v in GRID.items() if k not in ("mis_token", "mis_sequence")}
"""The issue's seven (the toy lab also ran token and sequence MIS)."""
LRS = (2e-5, 6e-5)
EXTRA_KEYS = ("loss/correction_masked_frac", "loss/cispo_clipped_frac")


def run_dir(name: str, seed: int, lr: float) -> Path:
    return WORK / f"{name}-seed{seed}-lr{lr:g}"


def source_dir(seed: int) -> Path:
    return WORK / f"source-seed{seed}"


def command(name: str, seed: int, lr: float, z: Sizing, generate: bool) -> list[str]:
    preset, extra = METHODS[name]
    out = source_dir(seed) if generate else run_dir(name, seed, lr)
    cmd = [".venv-vllm/bin/python", "-m", "mugrpo", "train", "--preset", preset, "--run-dir",
           str(out.relative_to(ROOT))]
    if not generate:
        cmd += ["--replay", str(source_dir(seed).relative_to(ROOT))]
    # The initial greedy evaluation is the same model in every run: only the source does it.
    return cmd + run_overrides(preset, seed, replace(z, lr=lr), first=generate) + extra


def masked(u: dict) -> float | None:
    """Tokens the method removed from the loss's numerator (veto + correction); None where the update
    had no loss tokens (no group with mixed rewards)."""
    if u.get("loss/veto_token_frac") is None and u.get("loss/correction_masked_frac") is None:
        return None
    return (u.get("loss/veto_token_frac") or 0.0) + (u.get("loss/correction_masked_frac") or 0.0)


def clip_binds(u: dict) -> float | None:
    if u.get("loss/clip_frac_low") is None:
        return None
    return (u.get("loss/clip_frac_low") or 0.0) + (u.get("loss/clip_frac_high") or 0.0)


def _stat(values) -> dict | None:
    values = [v for v in values if v is not None and v == v]
    return None if not values else {"mean": statistics.fmean(values), "std": statistics.pstdev(values),
                                    "values": values}


def with_derived(updates: list[dict]) -> list[dict]:
    """The run's update records with ``masked`` and ``clip_binds`` added (copies; the run is left as it is)."""
    return [{**u, "masked": masked(u), "clip_binds": clip_binds(u)} for u in updates]


def _update_mean(updates: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the updates that have it (None: no loss tokens in that update)."""
    values = [u[key] for u in updates if u.get(key) is not None]
    return statistics.fmean(values) if values else None


def _final_eval(run: dict, key: str, update: int) -> float | None:
    return next((e[key] for e in run["evals"] if e["update"] == update), None)


def summarise(result: dict) -> dict:
    """Per (method, lr): final held-out greedy accuracy per seed, KL(pi_b || pi_theta) by quarter of the
    stage, the masked fraction (mean, last quarter), PPO clip and CISPO cap fractions; means over the
    updates that had loss tokens, then over seeds."""
    groups: dict[str, list[dict]] = {}
    for r in result["runs"].values():
        if r.get("complete"):
            groups.setdefault(f"{r['method']}@{r['lr']:g}", []).append(r)
    mu, last = result["sizing"]["stale_mu"], result["sizing"]["updates"]
    out = {}
    for key, rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        ups = [with_derived(r["updates"]) for r in rs]

        def by_quarter(k: str) -> list[dict | None]:
            return [_stat([position_bins(u, k, mu)[q] for u in ups]) for q in range(4)]

        out[key] = {
            "method": rs[0]["method"], "lr": rs[0]["lr"], "num_seeds": len(rs), "seeds": [r["seed"] for r in rs],
            "final_greedy_acc": _stat([_final_eval(r, "greedy_acc", last) for r in rs]),
            "kl_by_quarter": by_quarter("loss/kl_behavior"),
            "rho_neg_by_quarter": by_quarter("loss/ratio_mean_neg"),
            "masked_frac": _stat([_update_mean(u, "masked") for u in ups]),
            "masked_frac_last_quarter": _stat([position_bins(u, "masked", mu)[-1] for u in ups]),
            "ppo_clip_frac": _stat([_update_mean(u, "clip_binds") for u in ups]),
            "cispo_clipped_frac": _stat([_update_mean(u, "loss/cispo_clipped_frac") for u in ups]),
            "final_response_len": _stat([_final_eval(r, "response_len_mean", last) for r in rs]),
            "wall_s": _stat([r["wall_s"] for r in rs]),
        }
    initial = [e["greedy_acc"] for r in result["runs"].values() if r.get("generated") for e in r.get("evals", [])
               if e["update"] == 0]
    out["_initial_greedy_acc"] = _stat(initial)
    return out


def run(args) -> dict:
    z = replace(Sizing(), eval_items=args.eval_items, eval_every=Sizing().updates, threads=args.threads,
                seeds=tuple(args.seeds))
    out = Path(args.out)
    result = read_figures(out) if out.is_file() else {"runs": {}}
    result.update({"benchmark": "smollm_corrections", "sizing": asdict(z), "lrs": list(args.lrs),
                   "methods": {k: {"preset": p, "overrides": o} for k, (p, o) in METHODS.items()}})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    names = [SOURCE] + [m for m in METHODS if m != SOURCE and (not args.only or m in args.only)]
    for seed in z.seeds:
        for lr in args.lrs:
            for name in names:
                key = f"{name}/seed{seed}/lr{lr:g}"
                if result["runs"].get(key, {}).get("complete"):
                    continue
                generate = name == SOURCE and lr == args.lrs[0] and not (source_dir(seed) / "config.yaml").is_file()
                if name == SOURCE and lr == args.lrs[0] and not generate:
                    continue  # the kept source is this run: a driver restarted after it finished
                cmd = command(name, seed, lr, z, generate)
                rd = ROOT / cmd[cmd.index("--run-dir") + 1]
                if rd.exists():
                    shutil.rmtree(rd)
                print(f"[corrections] {key} ({'generates' if generate else 'replays'}): {shlex.join(cmd)}", flush=True)
                t0 = time.perf_counter()
                with open(rd.with_suffix(".log"), "w") as log:
                    rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
                entry = {"method": name, "seed": seed, "lr": lr, "generated": generate, "command": shlex.join(cmd),
                         "returncode": rc, "wall_s": time.perf_counter() - t0, "loadavg_end": os.getloadavg(),
                         "complete": False}
                if (rd / "metrics.jsonl").is_file():
                    entry.update(summarize_run(rd))
                    for u, rec in zip(entry["updates"], _update_records(rd)):
                        u.update({k: rec.get(k) for k in EXTRA_KEYS})
                    entry["complete"] = rc == 0 and entry["totals"]["num_updates"] == z.updates
                result["runs"][key] = entry
                result["summary"] = summarise(result)
                write_result(out, "smollm_corrections", result, args, finished=False)
                final = next((e["greedy_acc"] for e in entry.get("evals", []) if e["update"] == z.updates), None)
                print(f"[corrections] {key}: rc {rc}, {entry['wall_s']:.0f} s, final greedy acc {final}", flush=True)
    write_result(out, "smollm_corrections", result, args)
    return result


def _update_records(rd: Path) -> list[dict]:
    from mugrpo.observability.loggers import read_metrics

    return [r for r in read_metrics(rd / "metrics.jsonl") if r["kind"] == "update"]


def table(result: dict) -> str:
    pct = lambda st: "-" if st is None else f"{100 * st['mean']:.2f}%"  # noqa: E731
    rows = ["| method | lr (S x lr) | seeds | final greedy acc (per seed) | KL(pi_b, pi_theta) by quarter of the stage "
            "| E[rho given A<0] by quarter | tokens masked (mean / last quarter) | PPO clip binds | CISPO weight capped "
            "| final answer tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    items = [(k, s) for k, s in result["summary"].items() if not k.startswith("_")]
    for _, s in sorted(items, key=lambda kv: (-kv[1]["lr"], -(kv[1]["final_greedy_acc"] or {"mean": 0})["mean"])):
        f = s["final_greedy_acc"]
        quarters = lambda qs: " / ".join("-" if q is None else f"{q['mean']:.3f}" for q in qs)  # noqa: E731
        per_seed = ", ".join(f"s{k} {v:.3f}" for k, v in zip(s["seeds"], f["values"]))
        length = "-" if s["final_response_len"] is None else f"{s['final_response_len']['mean']:.0f}"
        rows.append(f"| {s['method']} | {s['lr']:g} ({64 * s['lr']:.1e}) | {s['num_seeds']} | {f['mean']:.3f} ± "
                    f"{f['std']:.3f} ({per_seed}) | {quarters(s['kl_by_quarter'])} | {quarters(s['rho_neg_by_quarter'])} "
                    f"| {pct(s['masked_frac'])} / {pct(s['masked_frac_last_quarter'])} | {pct(s['ppo_clip_frac'])} "
                    f"| {pct(s['cispo_clipped_frac'])} | {length} |")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = {k: s for k, s in result["summary"].items() if not k.startswith("_")}
    methods = list(METHODS)
    lrs = sorted({s["lr"] for s in summary.values()})
    colors = dict(zip(methods, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    ax = axes[0]
    width = 0.8 / max(1, len(lrs))
    for j, lr in enumerate(lrs):
        for i, m in enumerate(methods):
            s = summary.get(f"{m}@{lr:g}")
            if not s or not s["final_greedy_acc"]:
                continue
            x = i + (j - (len(lrs) - 1) / 2) * width
            ax.bar(x, s["final_greedy_acc"]["mean"], width, color=colors[m], alpha=0.45 + 0.5 * (lr == max(lrs)))
            ax.plot([x] * len(s["final_greedy_acc"]["values"]), s["final_greedy_acc"]["values"], "k.", ms=4)
    initial = result["summary"].get("_initial_greedy_acc")
    if initial:
        ax.axhline(initial["mean"], ls="--", color="gray", lw=1)
    ax.set_xticks(range(len(methods)), methods, rotation=30, fontsize=8)
    ax.set_title("final held-out greedy accuracy (light: lr %g, dark: lr %g; dashed: start)" % (min(lrs), max(lrs)),
                 fontsize=8)
    hot = max(lrs)
    for ax, key, title in ((axes[1], "loss/kl_behavior", f"KL(pi_b || pi_theta), lr {hot:g}"),
                           (axes[2], "masked", f"tokens removed from the loss, lr {hot:g}")):
        for m in methods:
            ups = [u for r in result["runs"].values() if r["method"] == m and r["lr"] == hot and r.get("complete")
                   for u in with_derived(r["updates"]) if u.get(key) is not None]
            if not ups:
                continue
            pos = range(result["sizing"]["stale_mu"])
            pts = [(p, statistics.fmean(v)) for p in pos if (v := [u[key] for u in ups if u["update_in_stage"] == p])]
            # running mean over 8 positions: half the updates carry no loss tokens
            ys = [statistics.fmean(y for _, y in pts[max(0, i - 7):i + 1]) for i in range(len(pts))]
            ax.plot([p for p, _ in pts], ys, color=colors[m], label=m, lw=1.2)
        ax.set_xlabel("update's position in the stage (staleness)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    cap = "/".join(sorted({str(d["machine"]["cpu_capability"]) for d in result["drivers"]}))
    fig.suptitle(f"SmolLM2-135M, long worked answers, one stage of mu = {result['sizing']['stale_mu']} replayed "
                 f"identically per seed ({len({r['seed'] for r in result['runs'].values()})} seeds), CPU {cap}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def drivers(part: dict) -> list[dict]:
    """The command, machine and commit of each driver behind a results file in the schema. A merged
    file may be a part again (the committed results are redrawn from themselves); one from before the
    schema listed its drivers' commands and machines side by side."""
    figures = part["figures"]
    if "drivers" in figures:
        return figures["drivers"]
    if "machines" in figures:
        return [{"command": c, "machine": m, "commit": part["commit"]}
                for c, m in zip(figures["commands"], figures["machines"])]
    return [{"command": part["command"], "machine": part["machine"], "commit": part["commit"]}]


def report(args) -> dict:
    parts = [read_result(p) for p in args.parts]
    result = {k: v for k, v in parts[0]["figures"].items() if k not in ("commands", "machines", "command", "machine")}
    result["runs"] = {k: v for p in parts for k, v in p["figures"]["runs"].items()}
    result["drivers"] = [d for p in parts for d in drivers(p)]
    result["sizing"]["seeds"] = sorted({r["seed"] for r in result["runs"].values()})
    result["summary"] = summarise(result)
    write_result(OUT, "smollm_corrections", result, args)
    print(f"[corrections] wrote {OUT} and {plot(result, OUT.with_suffix('.png'))}")
    print(table(result))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="the source, then every method replaying it, per seed and lr")
    common_arguments(r, "smollm_corrections", seeds=[0, 1])
    r.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    r.add_argument("--only", nargs="*", help=f"methods to run (of {', '.join(METHODS)}); the source always runs")
    r.add_argument("--eval-items", type=int, default=64)
    r.add_argument("--threads", type=int, default=1)
    rep = sub.add_parser("report", help="merge results files (one per driver); summary, table, figure")
    rep.add_argument("parts", nargs="+")
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    {"run": run, "report": report}[args.verb](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
