"""Toy lab: the paper's staleness experiments (Figures 2/3 pattern) on a ~1M-parameter char model.

One command runs everything, sequentially, in one process::

    PYTHONPATH=. python -m benchmarks toy_lab            # full lab (see docs/BENCHMARKS.md)
    PYTHONPATH=. python -m benchmarks toy_lab --quick    # 1 seed, 2 presets, a few updates (into benchmarks/cache/)

Groups of runs (every run: same warm-started model, same update budget, same data budget; the
stale ones share the same mu):

- ``presets``: grpo (mu = 4), grpo-stale, grpo-stale-relaxed, m2po, mu-grpo;
- ``scopes``:  mu-grpo with the veto scope trigger / sequence / suffix_nontrigger (suffix is mu-grpo
  itself, none is grpo-stale-relaxed);
- ``delta``:   mu-grpo with other ``loss.veto_delta`` values (1e-4 is mu-grpo itself);
- ``adaptive``: mu-grpo with adaptive stages (``schedule.adaptive=kl``): mu is the longest stage, a
  stage ends once the KL guard trips, never before grpo's mu updates (not in the default groups;
  ``--groups presets,adaptive --out benchmarks/results/toy_lab_adaptive.json``).

Each run is ``mugrpo.training.trainer.train`` with a config built by ``load_config(preset, overrides=...)``.
The only addition is an evaluation of the *current* policy every ``--eval-every`` updates on a fixed
held-out set (:mod:`benchmarks.evaluate`): the trainer itself logs the reward of each stage's
behaviour policy only, which for a 2-stage run is two points. The evaluation wraps
``mugrpo.training.trainer.Trainer.update`` (looked up on the class inside ``train``); its time is measured and
subtracted from the run's clock.

Output: ``benchmarks/results/toy_lab.json`` (settings, machine, every run's curves, a summary per
experiment) and PNG figures next to it (:mod:`benchmarks.toy_lab.plot`). Run folders are temporary
(``benchmarks/cache/toy_lab/runs``) and removed after each run, except those named by ``--keep``.

``--setting long`` is the long-response lab of issue 13 (:mod:`benchmarks.toy_lab.long_task`: chain
sums with worked answers of 88-126 tokens (median 112), one stage of mu = 64, its own warm start), with its own groups
(``long``: the full grid at ``--lr``; ``long_paper``: grpo, grpo-stale-relaxed and mu-grpo at
``--paper-lr``, where S x lr matches the paper's 1024 x 1e-6) and its own defaults
(:data:`LONG_SIZE`); it writes ``benchmarks/results/toy_lab_long.json`` and keeps the run folders of
mu-grpo and grpo-stale-relaxed at seed 0 (stage rollouts and the final checkpoint) for
:mod:`benchmarks.toy_lab.triggers`.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.evaluate import UpdateEvaluator, patched_trainer
from benchmarks.suite import common_arguments, read_result, write_result
from benchmarks.toy_lab import long_task, warmstart

RESULTS = Path(__file__).resolve().parents[1] / "results"
PRESETS = ("grpo", "grpo-stale", "grpo-stale-relaxed", "m2po", "mu-grpo")
SCOPES = ("trigger", "sequence", "suffix_nontrigger")
DELTAS = (0.5, 1e-1, 1e-2, 1e-3, 1e-6)
LONG_GRID = ("grpo", "grpo-stale", "grpo-stale-relaxed", "m2po", "mu-grpo")
LONG_DELTAS = (1e-2, 1e-3)
PAPER_PRESETS = ("grpo", "grpo-stale-relaxed", "mu-grpo")
ADAPTIVE_KL = (0.01, 0.03)
"""``schedule.adaptive_kl_max`` values of the ``adaptive`` group (grpo's in-stage KL stays below ~0.01)."""


@dataclass
class LabSize:
    total_updates: int = 64
    stale_stages: int = 2
    """K for the stale presets: mu = total_updates / stale_stages."""
    grpo_mu: int = 4
    prompts_per_update: int = 8
    group_size: int = 8
    max_new_tokens: int = 0
    """0: the warm start's longest target plus EOS."""
    lr: float = 3e-4
    warmup_updates: int = 8
    """Linear lr warm-up. Without it Adam's first, sign-like steps (every weight moves by ~lr whatever
    its gradient) on a noisy 64-sequence policy gradient undo part of the SFT: at lr 1e-3 even grpo
    lost 25 points of pass@1 in its first 4 updates."""
    eval_every: int = 8
    eval_prompts: int = 128
    eval_samples: int = 2
    threads: int = 1
    """torch threads; 1 is faster than 2 on a 2-core machine that others share (measured)."""
    paper_lr: float = 0.0
    """lr of the ``long_paper`` group (0: not used)."""


LONG_SIZE = LabSize(total_updates=64, stale_stages=1, prompts_per_update=2, lr=1.5e-4, eval_every=16,
                    eval_prompts=128, eval_samples=1, paper_lr=1.6e-5)
"""The long setting: one stage of mu = 64 for the stale runs (grpo: 16 refreshes of mu = 4),
2 prompts x G = 8 per update (sized to the shared 2-core machine: a run is about 1M generated and
trained tokens). lr 1.5e-4 gives S x lr = 64 x 1.5e-4 = 9.6e-3, 9.6x the paper's 1024 x 1e-6;
paper_lr 1.6e-5 gives 1.0e-3, the paper's."""


def experiments(groups: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """(group, experiment name, preset, extra overrides)."""
    out = []
    if "presets" in groups:
        out += [("presets", p, p, []) for p in PRESETS]
    if "scopes" in groups:
        out += [("scopes", f"veto={s}", "mu-grpo", [f"loss.veto_scope={s}"]) for s in SCOPES]
    if "delta" in groups:
        out += [("delta", f"delta={d:g}", "mu-grpo", [f"loss.veto_delta={d}"]) for d in DELTAS]
    if "long" in groups:
        # most telling first: a partial grid then still answers claims 1-3
        out += [("long", p, p, []) for p in LONG_GRID[:1] + LONG_GRID[2:3] + LONG_GRID[4:]]
        out += [("long", "veto=trigger", "mu-grpo", ["loss.veto_scope=trigger"])]
        out += [("long", p, p, []) for p in LONG_GRID[1:2] + LONG_GRID[3:4]]
        out += [("long", f"delta={d:g}", "mu-grpo", [f"loss.veto_delta={d}"]) for d in LONG_DELTAS]
    if "long_paper" in groups:
        out += [("long_paper", f"{p}@paper-lr", p, ["@paper_lr"]) for p in PAPER_PRESETS[::-1]]
    if "adaptive" in groups:
        out += [("adaptive", f"adaptive-kl={k:g}", "mu-grpo", ["schedule.adaptive=kl", f"schedule.adaptive_kl_max={k}",
                 "schedule.adaptive_min_updates=4"]) for k in ADAPTIVE_KL]
    return out


def base_overrides(size: LabSize, model_dir: Path, spec, preset: str, seed: int, setting=warmstart
                   ) -> list[str]:
    schedule = ([f"schedule.updates_per_stage={size.grpo_mu}", "schedule.num_stages=null"] if preset == "grpo"
                else [f"schedule.num_stages={size.stale_stages}", "schedule.updates_per_stage=null"])
    seqs = size.prompts_per_update * size.group_size
    return setting.task_overrides(spec) + schedule + [
        f"model.name={model_dir}", f"schedule.total_updates={size.total_updates}",
        f"schedule.prompts_per_update={size.prompts_per_update}", f"schedule.micro_batch_size={seqs}",
        f"rollout.group_size={size.group_size}", f"rollout.max_new_tokens={size.max_new_tokens}",
        "rollout.batch_size=512", f"optim.lr={size.lr}", f"optim.warmup_updates={size.warmup_updates}",
        f"train.seed={seed}", f"train.threads={size.threads}",
        "train.progress=false", "train.save_stage_text=false", "train.save_final_model=false",
        f"task.eval_size={size.eval_prompts}", "checkpoint.keep_last=1",
        # The lab's model has 512 positions; the start-up context check needs prompt + answer to fit
        # (the lab's prompts are a few dozen characters, far below this limit).
        "task.max_prompt_tokens=256",
    ]


UPDATE_KEYS = ("loss/ratio_mean_neg", "loss/ratio_mean_pos", "loss/veto_token_frac", "loss/veto_seq_frac",
               "loss/trigger_frac", "loss/clip_frac_low", "loss/clip_frac_high", "loss/kl_behavior",
               "loss/entropy", "optim/grad_norm", "loss/m2po_tau", "loss/first_trigger_pos", "update_in_stage",
               "loss/correction_masked_frac", "loss/opsm_masked_seq_frac", "loss/icepop_masked_frac",
               "loss/cispo_clipped_frac", "loss/mis_masked_frac", "loss/mis_masked_seq_frac", "loss/ratio_mean")
STAGE_KEYS = ("perf/generate_s", "perf/optimize_s", "perf/sync_s", "perf/generate_tok_s", "stage/response_len_mean",
              "stage/num_sequences", "stage/truncated_frac", "stage/num_updates", "stage/end_reason")


def run_one(name: str, preset: str, overrides: list[str], seed: int, size: LabSize, model_dir: Path,
            spec, work: Path, setting=warmstart, keep: Path | None = None, replay: Path | None = None) -> dict:
    """One training run with evaluations; ``keep``: move the run folder there (with its stage
    rollouts as text) instead of deleting it; ``replay``: train on that run's stages instead of
    generating (``mugrpo train --replay``)."""
    from mugrpo import pipeline
    from mugrpo.config import load_config
    from mugrpo.observability.loggers import read_metrics
    from mugrpo.models.loading import load_tokenizer
    from mugrpo.rollout.tasks import build_task

    overrides = [f"optim.lr={size.paper_lr}" if o == "@paper_lr" else o for o in overrides]
    if keep is not None:
        overrides = overrides + ["train.save_stage_text=true"]
    cfg = load_config(preset, overrides=base_overrides(size, model_dir, spec, preset, seed, setting) + overrides)
    run_dir = work / f"{name.replace('=', '-')}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    task = build_task(cfg.task)
    at = range(0, size.total_updates + 1, size.eval_every)
    evaluator = UpdateEvaluator(load_tokenizer(str(model_dir)), task, cfg.task, at, samples=size.eval_samples,
                                max_new_tokens=size.max_new_tokens)
    t0, cpu0 = time.perf_counter(), _cpu_s()
    with patched_trainer(evaluator):
        pipeline.train(cfg, run_dir, **({"replay": replay} if replay is not None else {}))
    wall_s, cpu_s = time.perf_counter() - t0, _cpu_s() - cpu0
    records = read_metrics(run_dir / "metrics.jsonl")
    if keep is not None:
        shutil.rmtree(keep, ignore_errors=True)
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(run_dir), str(keep))
    shutil.rmtree(run_dir, ignore_errors=True)
    time_of = evaluator.clock(records)
    updates = [r for r in records if r["kind"] == "update"]
    stages = [r for r in records if r["kind"] == "stage"]
    return {
        "name": name, "preset": preset, "seed": seed, "overrides": overrides,
        **({"replay": str(replay)} if replay is not None else {}),
        "wall_s": wall_s, "cpu_s": cpu_s, "eval_s": evaluator.eval_s, "train_s": wall_s - evaluator.eval_s,
        "eval": [{**p, "time_s": time_of.get(p["update"], 0.0)} for p in evaluator.points],
        "updates": [{"update": r["update"], **{k: r.get(k) for k in UPDATE_KEYS if k in r}} for r in updates],
        "stages": [{"stage": r["stage"], "update": r["update"], "reward": r.get("reward/mean"),
                    **{k: r.get(k) for k in STAGE_KEYS}} for r in stages],
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def summarise(runs: list[dict]) -> dict:
    """Per experiment, mean and spread over seeds: final pass@1 (mean of the last two evaluations),
    peak pass@1 (update 0 included), the drop from peak to final, E[rho | A < 0] over the last 8
    updates, the vetoed token fraction over the run, and the run's wall-clock."""
    by_name: dict[str, list[dict]] = {}
    for r in runs:
        by_name.setdefault(r["name"], []).append(r)
    out = {}
    for name, rs in by_name.items():
        def stat(values):
            values = [v for v in values if v is not None and v == v]  # NaN: no such token in the run
            if not values:
                return None
            return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values),
                    "max": max(values), "values": values}

        finals = [statistics.fmean(p["pass1"] for p in r["eval"][-2:]) for r in rs]
        peaks = [max(p["pass1"] for p in r["eval"]) for r in rs]
        neg = [statistics.fmean([v for u in r["updates"][-8:] if (v := u.get("loss/ratio_mean_neg")) is not None]
                                or [float("nan")]) for r in rs]
        veto = [statistics.fmean(u.get("loss/veto_token_frac") or 0 for u in r["updates"]) for r in rs]
        out[name] = {"preset": rs[0]["preset"], "num_seeds": len(rs),
                     "initial_pass1": rs[0]["eval"][0]["pass1"], "final_pass1": stat(finals),
                     "peak_pass1": stat(peaks), "drop_from_peak": stat([p - f for p, f in zip(peaks, finals)]),
                     "late_ratio_mean_neg": stat(neg), "veto_token_frac_mean": stat(veto),
                     "num_stages": stat([len(r["stages"]) for r in rs]),
                     "train_s": stat([r["train_s"] for r in rs])}
    return out


def rounded(x):
    """Floats to 5 significant digits (the per-update curves are most of a lab's results file)."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def dump_json(result: dict) -> str:
    """Compact JSON, floats to 5 significant digits."""
    return json.dumps(rounded(result), separators=(",", ":")) + "\n"


def write_lab_result(path: Path, name: str, result: dict, args, finished: bool) -> None:
    """The lab's results in the suite's schema: compact, rounded, the lab's thread count beside the machine."""
    write_result(path, name, rounded(result), args, finished=finished, indent=None, threads=torch.get_num_threads(),
                 processor=platform.processor())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", choices=("short", "long"), default="short",
                    help="short: the original lab (2-term sums); long: worked chain sums of 88-126 tokens (median 112)")
    ap.add_argument("--groups", default=None,
                    help="comma list of presets, scopes, delta, adaptive (short) or long, long_paper (long); default: all")
    ap.add_argument("--keep", nargs="*", default=None, metavar="NAME:SEED",
                    help="keep these runs' folders under benchmarks/cache/toy_lab/kept (long default: "
                         "mu-grpo:0 grpo-stale-relaxed:0)")
    common_arguments(ap, "toy_lab", seeds=[0, 1, 2], quick="1 seed, grpo + mu-grpo, 16 updates")
    ap.set_defaults(out=None)  # benchmarks/results/toy_lab.json (long: toy_lab_long.json; --quick: benchmarks/cache/)
    ap.add_argument("--only", nargs="*", help="run only these experiment names (e.g. grpo mu-grpo)")
    ap.add_argument("--append", action="store_true",
                    help="add to the existing results file (same setting and sizes), skipping runs already in it")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra mugrpo config overrides for every run (e.g. optim.warmup_updates=8)")
    for f, v in asdict(LabSize()).items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=None, help=f"default {v} (short)")
    args = ap.parse_args(argv)
    long = args.setting == "long"
    defaults = asdict(LONG_SIZE if long else LabSize())
    size = LabSize(**{f: v if (v := getattr(args, f)) is not None else defaults[f] for f in defaults})
    groups = (args.groups or ("long,long_paper" if long else "presets,scopes,delta")).split(",")
    keep = set(args.keep if args.keep is not None else (["mu-grpo:0", "grpo-stale-relaxed:0"] if long else []))
    if args.quick:
        size.total_updates, size.eval_every = 16, 4
        size.eval_prompts = size.eval_prompts if long else 32
        args.seeds, args.only = args.seeds[:1], args.only or ["grpo", "mu-grpo"]
    torch.set_num_threads(size.threads)
    setting = long_task if long else warmstart
    spec = long_task.LongSpec() if long else warmstart.WarmStartSpec()
    if long and size.eval_prompts != spec.eval_size:
        raise SystemExit(f"[toy_lab] --eval-prompts must be {spec.eval_size} in the long setting: the held-out rows "
                         "are the data file's last LongSpec.eval_size rows, and more would reach into training rows")
    model_dir = setting.build(spec)
    warm = json.loads((model_dir / "warmstart.json").read_text())
    size.max_new_tokens = size.max_new_tokens or warm["max_new_tokens"]
    exps = [e for e in experiments(groups) if not args.only or e[1] in args.only]
    work = warmstart.CACHE / "runs"
    default = "toy_lab_long.json" if long else "toy_lab.json"
    # a smoke run never replaces the committed results: it writes under the git-ignored cache
    out_path = Path(args.out or (warmstart.CACHE.parent / f"quick_{default}" if args.quick else RESULTS / default))
    result = {"benchmark": "toy_lab_long" if long else "toy_lab", "setting": args.setting, "size": asdict(size),
              "extra_overrides": args.set, "warmstart": warm, "runs": []}
    if args.append and out_path.is_file():
        envelope = read_result(out_path)
        old = envelope["figures"]
        if old.get("size") != json.loads(dump_json({"size": asdict(size)}))["size"] or old.get("setting") != args.setting:
            raise SystemExit(f"[toy_lab] --append: {out_path} holds runs of other sizes or another setting; "
                             "use another --out or the same sizes")
        # the runs already there came from earlier commands (the envelope records this one)
        result["runs"] = old["runs"]
        result["earlier_commands"] = old.get("earlier_commands", []) + [envelope["command"]]
    done = {(r["name"], r["seed"]) for r in result["runs"]}
    t_all, cpu_all = time.perf_counter(), _cpu_s()
    for seed in args.seeds:  # seed-major: a partial result already has every experiment at seed 0
        for group, name, preset, overrides in exps:
            if (name, seed) in done:
                continue
            print(f"[toy_lab] {name} seed {seed} ...", flush=True)
            kept = warmstart.CACHE / "kept" / f"{out_path.stem}-{name}-s{seed}" if f"{name}:{seed}" in keep else None
            run = run_one(name, preset, args.set + overrides, seed, size, model_dir, spec, work, setting, kept)
            run["group"] = group
            result["runs"].append(run)
            ev = run["eval"]
            print(f"[toy_lab] {name} seed {seed}: pass@1 {ev[0]['pass1']:.3f} -> peak "
                  f"{max(p['pass1'] for p in ev):.3f} -> final {ev[-1]['pass1']:.3f} "
                  f"({run['train_s']:.0f} s train, {run['eval_s']:.0f} s eval)", flush=True)
            result["summary"] = summarise(result["runs"])
            result["total_s"] = time.perf_counter() - t_all
            result["total_cpu_s"] = _cpu_s() - cpu_all
            write_lab_result(out_path, "toy_lab", result, args, finished=False)
    if result["runs"]:
        result["summary"] = summarise(result["runs"])
        write_lab_result(out_path, "toy_lab", result, args, finished=True)
    if long:
        from benchmarks.toy_lab.plot_long import plot_all
    else:
        from benchmarks.toy_lab.plot import plot_all

    for path in plot_all(out_path):
        print(f"[toy_lab] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
