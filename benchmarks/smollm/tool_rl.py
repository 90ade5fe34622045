"""Issue 26, item 6: SmolLM2-135M warm-started on calculator traces, then RL with the tool.

Steps, each its own process (so each run's clock and peak memory are its own)::

    export PYTHONPATH=. OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    PY=.venv-vllm/bin/python
    $PY -m benchmarks smollm_tool_rl prepare                # demonstrations, RL rows, held-out rows
    $PY -m benchmarks smollm_tool_rl warmstart --steps 3    # mugrpo sft: the short warm start
    $PY -m benchmarks smollm_tool_rl probe                  # the warm-started model: greedy + 4 samples
    $PY -m benchmarks smollm_tool_rl run mu --seed 1        # mu-grpo, the whole run as one stage
    $PY -m benchmarks smollm_tool_rl run grpo --seed 1      # grpo, a fresh stage every update
    $PY -m benchmarks smollm_tool_rl run notool --seed 1    # mu-grpo, same questions, no tool
    $PY -m benchmarks smollm_tool_rl final mu --seed 1      # the trained model with and without the tool
    .venv/bin/python -m benchmarks smollm_tool_rl report    # JSON + figure from the run directories

**Task.** The two-call calculator task of docs/BENCHMARKS.md section 9 ("What is a * b + c * d?",
solved as ``a * b`` then ``<that> + c * d``; :func:`mugrpo.warmstart.demos.calculator_rows`). The
demonstrations use seed 0, the RL questions seed 2, the held-out items seed 1 (disjoint by text).

**Warm start.** ``mugrpo sft`` on the traces for ``--steps`` steps (8 traces a step, lr 1e-4): short on
purpose, so that the starting policy calls the tool but does not yet solve the task every time and
RL's groups have reward variance (a full warm start nearly solves this task greedily: section 9).

**Tool latency.** The tool the RL runs call is the built-in ``calculate`` behind a sleep of
``--latency`` seconds per call (as a sandbox or an API answers), with ``env.max_workers`` = 64 (the
calls of one turn of a stage run at once, as a sandbox pool would). Same name, schema and
docstring as the warm start's tool, so the prompt's tool protocol is token for token the same.

**Arms.** ``mu``: mu-grpo, one stage of all ``--updates`` updates; ``mu4``: mu-grpo in two stages
(mu = 4 at the default 8 updates); ``grpo``: grpo, a fresh stage
every update; ``notool``: mu-grpo from the same warm-started model, the instruction without its
tool part and no tool (what RL does with the same budget without the tool). Held-out greedy
accuracy with the tool every ``--eval-every`` updates (the trainer's evaluation), and at the end
with and without the tool (``final``: ``mugrpo eval`` on the final model).

Outputs under ``benchmarks/results/smollm_tool_rl/`` (``tool_rl.json``, ``tool_rl.png``); run
directories under ``benchmarks/cache/smollm_tool_rl/`` (git ignores it). A benchmark: it asserts
nothing about time.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.suite import command, common_arguments, read_figures, wrap_file, write_result

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "smollm_tool_rl"
CACHE = ROOT / "benchmarks" / "cache" / "smollm_tool_rl"
SFT_DIR = CACHE / "sft"
MODEL = SFT_DIR / "final_model"
PLAIN_INSTRUCTION = "Put your final answer within \\boxed{}."
ARMS = {"mu": ("mu-grpo", True, 1), "mu4": ("mu-grpo", True, 2), "grpo": ("grpo", True, None),
        "notool": ("mu-grpo", False, 1)}
"""arm: (preset, with the tool, stages of mu-grpo): mu = all updates in one stage, mu4 = two stages."""


STRICT_REWARD = "benchmarks.smollm.tool_rl:integer_answer"


def integer_answer(completion: str, answer: str, item: dict) -> float:
    """1.0 if the last ``\\boxed{}`` holds the answer as an integer literal, else 0.0.

    The math task's grader (math-verify) compares values, so ``\\boxed{361 * 25 + 607 * 67}``, the
    question itself, counts as 49694: without the tool, mu-grpo learned exactly that in 8 updates
    (greedy 0.625 from 0.03). Every arm here is trained and evaluated with this reward instead."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    value = boxed[-1].strip().replace(",", "") if boxed else ""
    return float(re.fullmatch(r"-?\d+", value) is not None and int(value) == int(answer))


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (CACHE / f"{name}.jsonl").read_text().splitlines() if x.strip()]


def prepare(args) -> None:
    from mugrpo.warmstart.demos import calculator_rows, write_jsonl

    write_jsonl(calculator_rows(args.traces, seed=0, num_calls=2), CACHE / "demos.jsonl")
    for name, seed, n in (("train", 2, args.rows), ("heldout", 1, args.heldout)):
        write_jsonl([{"question": r["question"], "answer": r["answer"]}
                     for r in calculator_rows(n, seed=seed, num_calls=2)], CACHE / f"{name}.jsonl")
    print(f"wrote {CACHE}/demos.jsonl ({args.traces}), train.jsonl ({args.rows}), heldout.jsonl ({args.heldout})")


def _task_overrides(tool: bool) -> list[str]:
    from mugrpo.warmstart.demos import CALCULATOR_INSTRUCTION

    instruction = CALCULATOR_INSTRUCTION if tool else PLAIN_INSTRUCTION
    return ["task.kind=math", "task.few_shot=[]", f"task.instruction={instruction}", "task.max_prompt_tokens=1024",
            f"task.reward_fn={STRICT_REWARD}"]


def warmstart(args) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "mugrpo", "sft", "--run-dir", str(SFT_DIR), f"warmstart.data={CACHE / 'demos.jsonl'}",
           f"warmstart.steps={args.steps}", f"warmstart.lr={args.lr}", "warmstart.batch_size=8",
           "train.progress=false", "warmstart.checkpoint_every=0"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    info = {"steps": args.steps, "lr": args.lr, "wall_s": time.perf_counter() - t0, "command": " ".join(cmd[1:])}
    write_result(OUT / "warmstart.json", "smollm_tool_rl", info, args)
    print(json.dumps(info))


def _eval(model: Path, label: str, tool: bool, extra: list[str]) -> dict:
    out = OUT / f"eval_{label}.json"
    cmd = [sys.executable, "-m", "mugrpo", "eval", "--model", str(model), "--task", f"calc={CACHE / 'heldout.jsonl'}",
           "--max-new-tokens", "200", "--out", str(out), "--samples", str(CACHE / f"samples_{label}.jsonl"),
           *extra, *_task_overrides(tool), *(["task.env=calculator", "env.max_turns=4", "env.max_tokens_per_turn=64"]
                                             if tool else [])]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"{label}: {time.perf_counter() - t0:.0f} s -> {out}")
    wrap_file(out, "smollm_tool_rl", command())  # the mugrpo eval report, in the suite's schema
    return read_figures(out)


def probe(args) -> None:
    """The warm-started (and the base) model on the held-out items: greedy and 4 samples (temperature 1)."""
    OUT.mkdir(parents=True, exist_ok=True)
    _eval(MODEL, "warm_tool", True, ["--k", "4"])
    if args.base:
        _eval(Path("smollm2-135m-instruct"), "base_tool", True, ["--k", "4"])


def slow_tool(latency_s: float):
    """The built-in ``calculate`` behind ``latency_s`` of waiting (its name, schema and docstring kept)."""
    from mugrpo.rollout.envs.builtin import calculate

    @functools.wraps(calculate)
    def wrapped(*a, **k):
        time.sleep(latency_s)
        return calculate(*a, **k)
    return wrapped


def arm_config(arm: str, seed: int, args) -> dict:
    from mugrpo.warmstart.demos import CALCULATOR_INSTRUCTION

    preset, tool, stages = ARMS[arm]
    config = {
        "preset": preset, "model.name": str(MODEL), "train.seed": seed,
        "schedule.total_updates": args.updates, "schedule.prompts_per_update": args.prompts,
        "rollout.group_size": args.group_size, "rollout.max_new_tokens": 200,
        "env.max_turns": 4, "env.max_tokens_per_turn": 64, "env.max_workers": 64,
        "task": {"few_shot": [], "instruction": CALCULATOR_INSTRUCTION if tool else PLAIN_INSTRUCTION,
                 "max_prompt_tokens": 1024, "reward_fn": STRICT_REWARD},
        "optim.lr": args.lr,
        "eval.num_items": args.heldout, "eval.every_updates": args.eval_every, "eval.every_stages": 0,
        "eval.max_new_tokens": 200, "eval.num_samples": args.eval_samples,
        "eval.at_start": False,  # the starting model's evaluation is the probe's (same items, same settings)
    }
    if preset == "mu-grpo":
        config["schedule.num_stages"] = stages
    else:
        config["schedule.updates_per_stage"] = 1
    return config


def run(args) -> None:
    import mugrpo

    run_dir = CACHE / f"{args.arm}_seed{args.seed}"
    config = arm_config(args.arm, args.seed, args)
    tools = [slow_tool(args.latency)] if ARMS[args.arm][1] else None
    t0 = time.perf_counter()
    result = mugrpo.train(config, train_dataset=_rows("train"), eval_dataset=_rows("heldout")[: args.heldout],
                          tools=tools, run_dir=run_dir)
    import torch

    info = {"arm": args.arm, "seed": args.seed, "wall_s": time.perf_counter() - t0, "latency_s": args.latency,
            "config": config, "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_avg_at_end": os.getloadavg(),
            "command": shlex.join(command()),
            "final_model": str(result.final_model)}
    (run_dir / "bench.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def final(args) -> None:
    """The trained model of ARM/seed on the held-out items, greedy + 4 samples, with the tool (tool
    arms) and without it, graded by :func:`integer_answer`."""
    model = CACHE / f"{args.arm}_seed{args.seed}" / "final_model"
    if ARMS[args.arm][1]:
        _eval(model, f"{args.arm}_seed{args.seed}_tool", True, ["--k", "4"])
    _eval(model, f"{args.arm}_seed{args.seed}_notool", False, ["--k", "4"])


# ---------------------------------------------------------------- report

def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def summarize(run_dir: Path) -> dict:
    """One run's evaluations on a training clock (wall-clock minus the evaluations' own seconds), its
    stages' rewards, tool use, tool waiting and the veto by turn."""
    arm, _, seed = run_dir.name.rpartition("_seed")
    bench = run_dir / "bench.json"
    info = json.loads(bench.read_text()) if bench.exists() else {"arm": arm, "seed": int(seed), "finished": False}
    records = _records(run_dir)
    eval_s, evals, stages, updates = 0.0, [], [], []
    for r in records:
        if r.get("kind") == "eval":
            evals.append({"update": r.get("update"), "time_s": r.get("time_s"), "train_clock_s": r["time_s"] - eval_s,
                          "greedy_acc": r.get("eval/greedy_acc"),
                          "sampled_acc": r.get(f"eval/avg_at_{r.get('eval/num_samples', 4)}", r.get("eval/avg_at_4")),
                          "tool_call_frac": r.get("eval/env/tool_call_frac")})
            eval_s += r.get("perf/eval_s", 0.0)
        elif r.get("kind") == "stage":
            n = max(r.get("stage/num_sequences", 1), 1)
            stages.append({"stage": r.get("stage"), "reward_mean": r.get("reward/mean"), "time_s": r.get("time_s"),
                           "generate_s": r.get("perf/generate_s"), "optimize_s": r.get("perf/optimize_s"),
                           "num_sequences": n, "tool_calls_per_traj": r.get("env/tool_calls", 0) / n,
                           "tool_call_frac": r.get("env/tool_call_frac"),
                           "tool_success_frac": r.get("env/tool_success_frac"),
                           "zero_var_group_frac": r.get("stage/zero_var_group_frac"),
                           "turns_mean": r.get("env/turns_mean")})
        elif r.get("kind") == "update":
            updates.append({"update": r.get("update"),
                            **{k: v for k, v in r.items() if k.startswith("loss/veto") or k.startswith("loss/first_trigger")
                               or k in ("loss/vetoed_frac", "loss/clip_frac", "loss/kl_behaviour")}})
    totals = {key: sum(st[key] or 0.0 for st in stages) for key in ("generate_s", "optimize_s")}
    totals.update(num_stages=len(stages), tool_calls=sum(st["tool_calls_per_traj"] * st["num_sequences"] for st in stages),
                  train_clock_s=(records[-1]["time_s"] - eval_s) if records else None)
    return {**info, "evals": evals, "stages": stages, "updates": updates, "totals": totals}


def time_to(evals: list[dict], target: float, key: str = "sampled_acc") -> float | None:
    """The training clock of the first evaluation whose ``key`` reaches ``target`` (None: never)."""
    for e in evals:
        if e.get(key) is not None and e[key] >= target - 1e-9:
            return e["train_clock_s"]
    return None


def _start_eval() -> dict | None:
    """The warm-started model's evaluation (the probe: same items, greedy + 4 samples) as update 0."""
    path = OUT / "eval_warm_tool.json"
    if not path.exists():
        return None
    m = read_figures(path)["tasks"]["calc"]
    return {"update": 0, "time_s": 0.0, "train_clock_s": 0.0, "greedy_acc": m["greedy_acc"],
            "sampled_acc": m["avg_at_4"], "tool_call_frac": m["env/tool_call_frac"]}


def veto_by_turn(run: dict) -> dict[str, float]:
    """Mean over the run's updates of the fraction of a policy turn's tokens the veto removed."""
    out = {}
    for k in sorted({k for u in run["updates"] for k in u if k.startswith("loss/veto_token_frac_turn")}):
        values = [u[k] for u in run["updates"] if u.get(k) is not None]
        if values:
            out[k.rsplit("_", 1)[1]] = sum(values) / len(values)
    return out


def compare(runs: list[dict]) -> dict:
    """Time to the same held-out accuracy, mu-grpo against grpo: the target is the highest sampled
    accuracy (avg@4) that every tool run reached; per run the training clock of its first evaluation
    at or above it."""
    tool_runs = [r for r in runs if r["arm"] in ("mu", "mu4", "grpo") and r["evals"]]
    if not tool_runs:
        return {}
    target = min(max(e["sampled_acc"] for e in r["evals"]) for r in tool_runs)
    per_run = {f"{r['arm']}_seed{r['seed']}": time_to(r["evals"], target) for r in tool_runs}
    means = {}
    for arm in ("mu", "mu4", "grpo"):
        times = [t for k, t in per_run.items() if k.startswith(arm + "_") and t is not None]
        means[arm] = sum(times) / len(times) if times else None
    ratios = {f"grpo_over_{arm}": means["grpo"] / means[arm] for arm in ("mu", "mu4") if means[arm] and means["grpo"]}
    return {"target_sampled_acc": target, "train_clock_s_to_target": per_run, "mean_s": means, **ratios}


def report(args) -> None:
    start = _start_eval()
    runs = [summarize(d) for d in sorted(CACHE.glob("*_seed*")) if (d / "metrics.jsonl").exists()]
    for r in runs:
        if start and r["arm"] != "notool":
            r["evals"].insert(0, dict(start))
        r["veto_by_turn"] = veto_by_turn(r)
    finals = {p.stem[len("eval_"):]: read_figures(p)["tasks"]["calc"] for p in sorted(OUT.glob("eval_*.json"))}
    out = {"warmstart": read_figures(OUT / "warmstart.json") if (OUT / "warmstart.json").exists() else None,
           "comparison": compare(runs), "runs": runs, "final_evals": finals}
    write_result(args.out, "smollm_tool_rl", out, args)  # the machine is the report's; each run's is in its bench.json
    print(f"wrote {args.out} ({len(runs)} runs)")
    for r in runs:
        accs = [(e["update"], e["greedy_acc"], e["sampled_acc"]) for e in r["evals"]]
        print(f"{r['arm']:7s} seed {r['seed']}: {json.dumps({k: v if v is None else round(v, 1) for k, v in r['totals'].items()})}")
        print(f"{r['arm']:7s} seed {r['seed']}: wall {r.get('wall_s', float('nan')):.0f} s, "
              f"(update, greedy, avg@4) {accs}, veto by turn {r['veto_by_turn']}")
    print(json.dumps(out["comparison"], indent=1))
    figure(runs)


def figure(runs: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plotting import finish

    fig, (acc, reward, veto) = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"mu": "tab:blue", "mu4": "tab:green", "grpo": "tab:orange", "notool": "tab:gray"}
    for r in runs:
        style = dict(color=colors.get(r["arm"]), marker="o", ls="-" if r["seed"] == 1 else "--",
                     label=f"{r['arm']} seed {r['seed']}")
        acc.plot([e["train_clock_s"] / 60 for e in r["evals"]], [e["sampled_acc"] for e in r["evals"]], **style)
        done = [s for s in r["stages"] if s.get("time_s") is not None]
        reward.plot([s["time_s"] / 60 for s in done], [s["reward_mean"] for s in done], **style)
    # The veto never fired at lr 1e-5 (every run's veto_by_turn is 0); the lr 5e-5 mu-grpo run, kept
    # as what did not work, shows where it acts once the policy drifts.
    hot = OUT / "lr5e-5_mu_seed1_metrics.jsonl.gz"  # a raw log, kept compressed beside the result it backs
    if hot.exists():
        lines = gzip.decompress(hot.read_bytes()).decode().splitlines()
        ups = [json.loads(x) for x in lines if x.strip() and json.loads(x)["kind"] == "update"]
        for turn in range(3):
            key = f"loss/veto_token_frac_turn{turn}"
            veto.plot([u["update"] for u in ups], [u.get(key) or 0.0 for u in ups], marker="o", label=f"policy turn {turn}")
        veto.plot([u["update"] for u in ups], [u["loss/log_ratio_abs_mean"] for u in ups], color="k", ls=":",
                  label="mean |log ratio|")
    acc.set(title="held-out accuracy, avg@4 (with the tool)", xlabel="training clock, evaluations excluded (min)")
    reward.set(title="training reward (stage mean, at the stage's end)", xlabel="wall-clock, evaluations included (min)")
    veto.set(title="veto, mu-grpo at lr 5e-5 (0 in every lr 1e-5 run)", xlabel="update",
             ylabel="fraction of the turn's tokens removed")
    finish(fig, (acc, reward, veto), OUT / "tool_rl.png", legend_size=7)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--traces", type=int, default=48)
    s.add_argument("--rows", type=int, default=256)
    s.add_argument("--heldout", type=int, default=32)
    s = sub.add_parser("warmstart")
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--lr", type=float, default=1e-4)
    s = sub.add_parser("probe")
    s.add_argument("--base", action="store_true", help="also the base model")
    for name in ("run", "final"):
        s = sub.add_parser(name)
        s.add_argument("arm", choices=sorted(ARMS))
        s.add_argument("--seed", type=int, default=1)
        if name == "run":
            s.add_argument("--updates", type=int, default=8)
            s.add_argument("--prompts", type=int, default=4, help="prompts per update")
            s.add_argument("--group-size", type=int, default=8)
            s.add_argument("--lr", type=float, default=1e-5)
            s.add_argument("--heldout", type=int, default=32, help="held-out items per evaluation")
            s.add_argument("--eval-every", type=int, default=4)
            s.add_argument("--eval-samples", type=int, default=4, help="sampled answers per held-out item (avg@k)")
            s.add_argument("--latency", type=float, default=0.5, help="seconds each tool call waits")
    common_arguments(sub.add_parser("report"), "smollm_tool_rl")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    {"prepare": prepare, "warmstart": warmstart, "probe": probe, "run": run, "final": final, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
