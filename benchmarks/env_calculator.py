"""SmolLM2-135M with a calculator tool: tool use, accuracy, mu-grpo vs grpo, the rollout phase, memory.

Issue 20, item 8. One command per run (each its own process, so its peak RSS is its own), then a
report that reads the run directories::

    # one arm (a few minutes on 2 shared cores); ARM: tool_mu, tool_grpo, notool_mu
    PYTHONPATH=. OMP_NUM_THREADS=2 .venv-vllm/bin/python -m benchmarks env_calculator run ARM --seed 1
    # the table and the figure from the stored run directories (no training)
    PYTHONPATH=. .venv/bin/python -m benchmarks env_calculator report

The task is ``examples/env_calculator.py``'s: "What is a * b + c?" with a 3-digit a, 2-digit b and
3-digit c, which the 135M model (4-bit GGUF weights) mostly gets wrong in its head. Arms:

- ``tool_mu``: mu-grpo with the ``calculate`` tool, the whole run as ONE stage (mu = all updates);
- ``tool_grpo``: grpo with the tool, a fresh stage every ``--grpo-refresh`` updates (default 1);
- ``notool_mu``: mu-grpo, same model, questions and instruction minus the tool part, no tool.

Held-out accuracy is the trainer's own greedy evaluation (``eval.every_updates``) on held-out items,
run with the environment (so the evaluated model may call the tool too). Tool counts come from the
stage records (``env/tool_calls``, ``env/tool_errors``, per trajectory). The rollout phase: seconds
per generated token (``perf/generate_s`` / response tokens) of each stage. Peak memory: the run
process's max RSS (``resource.getrusage``), recorded by ``run``.

Output: ``benchmarks/results/env_calculator.json`` (rewritten by ``report``) and
``benchmarks/results/env_calculator.png``; run directories under ``benchmarks/cache/env_calculator/``.
Benchmarks report; they never assert on time.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import sys
import time
from pathlib import Path

from benchmarks.suite import command, common_arguments, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "benchmarks" / "cache" / "env_calculator"

TOOL_INSTRUCTION = "Use the calculate tool, then put your final answer within \\boxed{}."
PLAIN_INSTRUCTION = "Put your final answer within \\boxed{}."
ARMS = {"tool_mu": ("mu-grpo", True), "tool_grpo": ("grpo", True), "notool_mu": ("mu-grpo", False)}


def arm_config(arm: str, seed: int, args) -> dict:
    preset, tool = ARMS[arm]
    config = {
        "preset": preset,
        "model.name": "smollm2-135m-instruct",
        "train.seed": seed,
        "schedule.total_updates": args.updates,
        "schedule.prompts_per_update": args.prompts,
        "rollout.group_size": args.group_size,
        "rollout.max_new_tokens": args.max_new_tokens,
        "rollout.engine": args.engine,
        "env.max_turns": args.max_turns,
        "task": {"few_shot": [], "instruction": TOOL_INSTRUCTION if tool else PLAIN_INSTRUCTION,
                 "eval_size": max(args.eval_items, 8), "max_prompt_tokens": 512},
        "eval.num_items": args.eval_items,
        "eval.every_updates": args.eval_every,
        "eval.every_stages": 0,
    }
    if preset == "mu-grpo":
        config["schedule.num_stages"] = 1
    else:
        config["schedule.updates_per_stage"] = args.grpo_refresh
    return config


def run(args) -> None:
    sys.path.insert(0, str(ROOT))
    import mugrpo
    from examples.env_calculator import arithmetic_rows
    from mugrpo.rollout.envs.builtin import calculate

    run_dir = WORK / f"{args.arm}_seed{args.seed}"
    config = arm_config(args.arm, args.seed, args)
    tools = [calculate] if ARMS[args.arm][1] else None
    t0 = time.perf_counter()
    result = mugrpo.train(config, train_dataset=arithmetic_rows(args.rows), tools=tools, run_dir=run_dir)
    wall = time.perf_counter() - t0
    info = {"arm": args.arm, "seed": args.seed, "wall_s": wall, "config": config,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "command": shlex.join(command()),
            "run_dir": str(result.run_dir.relative_to(ROOT) if Path(result.run_dir).is_absolute() else result.run_dir)}
    (run_dir / "bench.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def _per_traj(stage: dict, key: str) -> float:
    return stage.get(key, 0.0) / max(stage.get("stage/num_sequences", 1), 1)


def summarize(run_dir: Path) -> dict:
    bench = run_dir / "bench.json"
    arm, _, seed = run_dir.name.rpartition("_seed")
    # a run stopped before its end has no bench.json: its records still count, marked unfinished
    info = json.loads(bench.read_text()) if bench.exists() else {"arm": arm, "seed": int(seed), "finished": False}
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    stages = [r for r in records if r.get("kind") == "stage"]
    evals = [r for r in records if r.get("kind") == "eval"]
    updates = [r for r in records if r.get("kind") == "update"]
    stage_rows = []
    for s in stages:
        tokens = s.get("env/num_policy_tokens", 0) + s.get("env/num_env_tokens", 0)
        policy = s.get("env/num_policy_tokens") or s.get("stage/response_len_mean", 0) * s.get("stage/num_sequences", 0)
        stage_rows.append({
            "stage": s.get("stage"), "num_sequences": s.get("stage/num_sequences"),
            "reward_mean": s.get("reward/mean"), "generate_s": s.get("perf/generate_s"),
            "num_policy_tokens": policy, "num_response_tokens": tokens or policy,
            "generate_ms_per_policy_token": 1000 * s.get("perf/generate_s", 0) / max(policy, 1),
            "tool_calls_per_traj": _per_traj(s, "env/tool_calls"),
            "tool_errors_per_traj": _per_traj(s, "env/tool_errors"),
            "tool_errors_frac_of_calls": s.get("env/tool_errors", 0) / max(s.get("env/tool_calls", 0), 1),
            "turns_mean": s.get("env/turns_mean"), "truncated_frac": s.get("stage/truncated_frac"),
            "optimize_s": s.get("perf/optimize_s"), "time_s": s.get("time_s")})
    eval_rows = [{"update": e.get("update", e.get("step")), "time_s": e.get("time_s"),
                  **{k: v for k, v in e.items() if k.startswith("eval/") and isinstance(v, (int, float))}}
                 for e in evals]
    update_rows = [{"update": u.get("update"), "time_s": u.get("time_s"), "reward_mean": u.get("reward/mean"),
                    "tool_calls_per_traj": _per_traj(u, "env/tool_calls") if "env/tool_calls" in u else None}
                   for u in updates]
    return {**info, "stages": stage_rows, "evals": eval_rows, "updates": update_rows}


def report(args) -> None:
    runs = [summarize(d) for d in sorted(WORK.glob("*_seed*")) if (d / "metrics.jsonl").exists()]
    write_result(args.out, "env_calculator", {"runs": runs}, args)  # the machine is the report's, not the runs'
    print(f"wrote {args.out} ({len(runs)} runs)")
    figure(runs)


def _eval_key(run: dict) -> str | None:
    keys = sorted({k for e in run["evals"] for k in e if k.startswith("eval/greedy") or k.startswith("eval/avg_at")})
    return keys[0] if keys else None


def figure(runs: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plotting import finish

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        label = f"{r['arm']} s{r['seed']}"
        key = _eval_key(r)
        if key:
            pts = [(e["time_s"] / 60, e[key]) for e in r["evals"] if key in e]
            axes[0].plot(*zip(*pts), marker="o", label=label)
        # the update records carry no reward: the stage records do (one point per stage, at its end)
        stages = [st for st in r["stages"] if st.get("time_s") is not None]
        if stages:
            axes[1].plot([st["time_s"] / 60 for st in stages], [st["reward_mean"] for st in stages], marker="s", label=label)
            axes[2].plot([st["stage"] for st in stages], [st["tool_calls_per_traj"] for st in stages], marker="s", label=label)
    axes[0].set(title="held-out greedy accuracy", xlabel="wall-clock (min)")
    axes[1].set(title="training reward (per stage)", xlabel="wall-clock at stage end (min)")
    axes[2].set(title="tool calls per trajectory (training)", xlabel="stage")
    finish(fig, axes, RESULTS / "env_calculator.png")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("arm", choices=sorted(ARMS))
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--updates", type=int, default=8)
    r.add_argument("--prompts", type=int, default=4, help="prompts per update")
    # 0 turns evaluation off (a run kept for its rollout timings only)
    r.add_argument("--group-size", type=int, default=8)
    r.add_argument("--max-new-tokens", type=int, default=160)
    r.add_argument("--max-turns", type=int, default=3)
    r.add_argument("--eval-items", type=int, default=16, help="0: no evaluation")
    r.add_argument("--eval-every", type=int, default=4)
    r.add_argument("--rows", type=int, default=256)
    r.add_argument("--engine", default="vllm")
    r.add_argument("--grpo-refresh", type=int, default=1, help="grpo's updates per stage (a fresh stage every N)")
    common_arguments(sub.add_parser("report"), "env_calculator")
    args = p.parse_args(argv)
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
