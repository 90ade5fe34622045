"""The off-policy corrections side by side on identical stale rollouts (issue 21 part 4), in the long toy lab.

    PYTHONPATH=. OMP_NUM_THREADS=1 python -m benchmarks toy_lab_corrections --seeds 0 1 2
    PYTHONPATH=. python -m benchmarks toy_lab_corrections --plot      # figure + table from the results file

Setting: docs/BENCHMARKS.md section 1b (long worked chain sums, the same warm start and sizes,
:data:`benchmarks.toy_lab.run.LONG_SIZE`): one stage of mu = 64 updates, 2 prompts x G = 8 per
update, at two learning rates: ``--lrs`` (default 1.5e-4, S x lr = 9.6x the paper's 1024 x 1e-6, and
1.6e-5, the paper's S x lr).

Per seed, the first run (IcePop at the first lr, which needs the trainer's recomputed behaviour
log-probs, so its stage data carries both the engine's and the trainer's) generates stage 0; its
run folder is kept, and every other run of that seed *replays* it (``mugrpo train --replay``,
:mod:`mugrpo.stages.replay`): the same 1,024 rollouts, behaviour log-probs and advantages, so the
methods differ only in their updates. Stage-0 data does not depend on the lr (it is sampled from the
warm start), so one source serves both lrs.

Output: ``benchmarks/results/toy_lab_corrections.json`` (every run's evaluation curve and per-update
diagnostics, a summary per method and lr) and ``toy_lab_corrections.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.corrections_grid import METHODS, SOURCE
from benchmarks.suite import RESULTS, common_arguments, read_figures, read_result
from benchmarks.toy_lab import long_task, warmstart
from benchmarks.toy_lab.run import LONG_SIZE, LabSize, _cpu_s, run_one, write_lab_result

COMMON = ["task.max_prompt_tokens=256"]
"""For every run: the 1M-parameter model has 512 positions, and prompt (~30 tokens here) + 127 new tokens
must fit (the context check at start); no prompt comes near 256, so nothing is truncated or skipped."""
OWN_DATA = {"grpo": ("grpo", [])}
"""Reference runs that generate their own stages (grpo refreshes every 4 updates, so it cannot replay
one stage of 64); only with ``--only grpo``."""
OUT = RESULTS / "toy_lab_corrections.json"


def masked_frac(update: dict) -> float:
    """Tokens the method removed from the loss's numerator: the veto's plus the correction's."""
    return (update.get("loss/veto_token_frac") or 0.0) + (update.get("loss/correction_masked_frac") or 0.0)


def summarise(runs: list[dict]) -> dict:
    """Per (method, lr): final pass@1 (mean of the last two evaluations), KL(pi_b || pi_theta) by
    quarter of the stage, the masked fraction and the PPO/CISPO clipped fraction, each over seeds."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(f"{r['name']}@{r['lr']:g}", []).append(r)

    def stat(values):
        values = [v for v in values if v is not None and v == v]
        return None if not values else {"mean": statistics.fmean(values), "std": statistics.pstdev(values),
                                        "values": values}

    out = {}
    for key, rs in groups.items():
        def quarters(r, k):
            n = len(r["updates"]) // 4
            return [statistics.fmean([u.get(k) or 0.0 for u in r["updates"][q * n:(q + 1) * n]]) for q in range(4)]

        clip = [statistics.fmean([(u.get("loss/clip_frac_low") or 0) + (u.get("loss/clip_frac_high") or 0)
                                  for u in r["updates"]]) for r in rs]
        out[key] = {
            "method": rs[0]["name"], "lr": rs[0]["lr"], "num_seeds": len(rs), "seeds": [r["seed"] for r in rs],
            "initial_pass1": stat([r["eval"][0]["pass1"] for r in rs]),
            "final_pass1": stat([statistics.fmean(p["pass1"] for p in r["eval"][-2:]) for r in rs]),
            "kl_by_quarter": [stat([quarters(r, "loss/kl_behavior")[q] for r in rs]) for q in range(4)],
            "masked_frac": stat([statistics.fmean(masked_frac(u) for u in r["updates"]) for r in rs]),
            "masked_frac_last_quarter": stat([statistics.fmean(masked_frac(u) for u in
                                                               r["updates"][-len(r["updates"]) // 4:]) for r in rs]),
            "ppo_clip_frac": stat(clip),
            "cispo_clipped_frac": stat([statistics.fmean(u.get("loss/cispo_clipped_frac") or 0.0
                                                         for u in r["updates"]) for r in rs]),
            "train_s": stat([r["train_s"] for r in rs]),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, "toy_lab_corrections", seeds=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=[LONG_SIZE.lr, LONG_SIZE.paper_lr])
    ap.add_argument("--only", nargs="*", help=f"methods to run (of {', '.join(METHODS)}); the source ({SOURCE}) "
                                              "always runs first at the first lr")
    ap.add_argument("--eval-every", type=int, default=LONG_SIZE.eval_every)
    ap.add_argument("--total-updates", type=int, default=LONG_SIZE.total_updates,
                    help="the one stage's length mu (smoke tests only: the comparison is at 64)")
    ap.add_argument("--plot", action="store_true", help="only redraw the figure and print the table")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine these results files (e.g. one driver per "
                    "seed, run side by side) into --out, then exit")
    args = ap.parse_args(argv)
    out_path = Path(args.out)
    if args.merge:
        parts = [read_result(p) for p in args.merge]
        figures = [p["figures"] for p in parts]
        merged = {**figures[0], "runs": [r for f in figures for r in f["runs"]],
                  "parts": [{"command": p["command"], "machine": p["machine"], "commit": p["commit"],
                             "session_s": f.get("session_s"), "session_cpu_s": f.get("session_cpu_s")}
                            for p, f in zip(parts, figures)]}
        merged["summary"] = summarise(merged["runs"])
        write_lab_result(out_path, "toy_lab_corrections", merged, args, finished=True)
        print(f"[corrections] merged {len(merged['runs'])} runs into {out_path}")
        return 0
    if args.plot:
        from benchmarks.toy_lab.plot_corrections import plot, table

        print(f"[corrections] wrote {plot(out_path)}")
        print(table(read_figures(out_path)))
        return 0
    torch.set_num_threads(1)
    spec = long_task.LongSpec()
    model_dir = long_task.build(spec)
    warm = json.loads((model_dir / "warmstart.json").read_text())
    size = LabSize(**{**asdict(LONG_SIZE), "eval_every": args.eval_every, "total_updates": args.total_updates})
    size.max_new_tokens = warm["max_new_tokens"]
    result = {"benchmark": "toy_lab_corrections", "size": asdict(size), "warmstart": warm,
              "methods": {k: {"preset": p, "overrides": o} for k, (p, o) in METHODS.items()}, "runs": []}
    if out_path.is_file():  # append: keep what ran, skip it
        envelope = read_result(out_path)
        result["runs"] = envelope["figures"]["runs"]
        result["earlier_commands"] = envelope["figures"].get("earlier_commands", []) + [envelope["command"]]
    done = {(r["name"], r["seed"], r["lr"]) for r in result["runs"]}
    names = [SOURCE] + [m for m in METHODS if m != SOURCE and (not args.only or m in args.only)]
    names += [m for m in OWN_DATA if args.only and m in args.only]
    work = warmstart.CACHE / "runs"
    t_all, cpu_all = time.perf_counter(), _cpu_s()
    for seed in args.seeds:
        source = warmstart.CACHE / "kept" / f"corrections-source-s{seed}"
        for lr in args.lrs:
            for name in names:
                if (name, seed, lr) in done:
                    continue
                is_source = name == SOURCE and lr == args.lrs[0] and not (source / "config.yaml").is_file()
                preset, overrides = METHODS[name] if name in METHODS else OWN_DATA[name]
                run_size = LabSize(**{**asdict(size), "lr": lr})
                how = "(replays)" if name not in OWN_DATA and not is_source else "(generates)"
                print(f"[corrections] {name} lr {lr:g} seed {seed} {how} ...", flush=True)
                own = is_source or name in OWN_DATA
                run = run_one(name, preset, COMMON + overrides, seed, run_size, model_dir, spec, work, long_task,
                              keep=source if is_source else None, replay=None if own else source)
                run.update(lr=lr, replayed=not own)
                result["runs"].append(run)
                ev = run["eval"]
                print(f"[corrections] {name} lr {lr:g} seed {seed}: pass@1 {ev[0]['pass1']:.3f} -> final "
                      f"{statistics.fmean(p['pass1'] for p in ev[-2:]):.3f} ({run['train_s']:.0f} s train, "
                      f"{run['eval_s']:.0f} s eval, {run['cpu_s']:.0f} s CPU)", flush=True)
                result["summary"] = summarise(result["runs"])
                result["session_s"] = time.perf_counter() - t_all
                result["session_cpu_s"] = _cpu_s() - cpu_all
                write_lab_result(out_path, "toy_lab_corrections", result, args, finished=False)
    write_lab_result(out_path, "toy_lab_corrections", result, args, finished=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
