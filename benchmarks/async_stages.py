"""The paper's asynchronous table in miniature: Mu-GRPO with stages generated ahead against one rollout
service, beside the synchronous runs, on this machine (issue 33 item 5). A benchmark: it asserts nothing.

Arms (each its own ``mugrpo train`` process; the same task, model, budget and seed across arms):

- ``sync``: mu-grpo, the engine in the trainer's process, both cores (today's default loop);
- ``async``: mu-grpo with ``schedule.async_stages=1`` against one ``mugrpo serve`` process, the service
  pinned to core 1 and the trainer to core 0 (``taskset``), one thread each;
- ``sync_split``: the same two processes and cores with ``schedule.async_stages=0``: what the split
  costs without generating ahead;
- ``grpo``: the grpo preset, in process, both cores.

Reported per run: the training clock (the last record's ``time_s``), the held-out accuracy of the final
evaluation (``eval/greedy_acc``, ``eval/avg_at_n``), the trainer's and the engine's idle fractions, and
the policy lag. With ``async_stages`` >= 1 the idle fractions are the run's own metrics
(``perf/trainer_idle_frac``, ``perf/engine_idle_frac``, weighted by each stage's interval); for a
synchronous run they follow from its stage records: the trainer idles while the stage is synced,
generated and scored, and the engine idles for the rest of the interval.

    PYTHONPATH=. .venv/bin/python -m benchmarks async_stages --updates 8 --stages 4 --prompts 4 --group-size 8 \
        --eval-items 32 --seeds 1 2 3                     # results/async_stages.json
    PYTHONPATH=. .venv/bin/python -m benchmarks async_stages --task calculator --updates 8 --stages 4 --prompts 2 \
        --group-size 4 --eval-items 16 --seeds 1 2 3       # results/async_stages_calculator.json
    PYTHONPATH=. .venv/bin/python -m benchmarks async_stages --figure [--out FILE]  # redraw a figure from its results

``--task calculator``: docs/BENCHMARKS.md section 10's agent task: "What is a * b + c * d?" solved by two calls
of the built-in calculator, the tool behind a 0.5 s sleep (``benchmarks/async_tools.py``), graded by an
integer literal in the last ``\\boxed{}``. The base model never calls a tool (section 9), so every arm
starts from the same short warm start (``mugrpo sft``, 3 steps of 8 of 48 traces, lr 1e-4: section 10's),
made once and kept in the cache; RL at lr 1e-5 as section 10. Held-out: 32 items of their own (seed 1).
Run directories go under ``benchmarks/cache/async_stages/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.suite import common_arguments, write_result
from mugrpo import faults

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / "cache" / "async_stages"
ARMS = ("sync", "async", "sync_split", "grpo")
CALC_MODEL = CACHE / "calc_sft" / "final_model"


def _env(threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{ROOT / 'benchmarks'}",
           "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in faults.VARIABLES:
        env.pop(key, None)
    return env


def task_model(task: str) -> str:
    """The model the trainer starts from and a service first serves: the calculator's warm start, else the
    config's default."""
    from mugrpo.config.rollout_sections import ModelConfig

    return str(CALC_MODEL) if task == "calculator" else ModelConfig.name


def task_overrides(task: str, args) -> list[str]:
    common = [f"model.name={task_model(task)}", f"schedule.total_updates={args.updates}",
              f"schedule.prompts_per_update={args.prompts}",
              f"rollout.group_size={args.group_size}", f"eval.num_items={args.eval_items}", "eval.at_start=false",
              "eval.every_stages=1000", "eval.every_updates=0",  # one evaluation: the last stage's
              "train.progress=false", f"rollout.engine={args.engine}",
              # the HF arms run float32 on both sides; vLLM's resolve by the machine (auto), as `mugrpo serve` does
              "rollout.dtype=" + ("float32" if args.engine == "hf" else "auto")]
    if task == "default":
        return common
    from mugrpo.warmstart.demos import CALCULATOR_INSTRUCTION

    return [*common, "task.kind=math", f"task.name={CACHE / 'calc_train.jsonl'}",
            f"task.eval_path={CACHE / 'calc_heldout.jsonl'}", "task.few_shot=[]",
            f"task.instruction={CALCULATOR_INSTRUCTION}", "task.max_prompt_tokens=1024",
            "task.reward_fn=benchmarks.smollm.tool_rl:integer_answer", "optim.lr=1e-5",
            "task.tools=[async_tools:slow_calculate]", "env.max_turns=4", "env.max_tokens_per_turn=64",
            "env.max_workers=64", "rollout.max_new_tokens=200", "eval.max_new_tokens=200"]


def prepare_calculator(rows: int = 256, heldout: int = 32, traces: int = 48, steps: int = 3) -> None:
    """The questions (training seed 2, held-out seed 1, demonstrations seed 0: disjoint, as section 10),
    and the warm-started model every arm starts from, made once (``mugrpo sft``, section 10's settings)."""
    from mugrpo.warmstart.demos import calculator_rows, write_jsonl

    for name, seed, n in (("calc_train", 2, rows), ("calc_heldout", 1, heldout)):
        write_jsonl([{"question": r["question"], "answer": r["answer"]}
                     for r in calculator_rows(n, seed=seed, num_calls=2)], CACHE / f"{name}.jsonl")
    if (CALC_MODEL / "config.json").is_file():
        return
    write_jsonl(calculator_rows(traces, seed=0, num_calls=2), CACHE / "calc_demos.jsonl")
    shutil.rmtree(CALC_MODEL.parent, ignore_errors=True)
    cmd = [sys.executable, "-m", "mugrpo", "sft", "--run-dir", str(CALC_MODEL.parent),
           f"warmstart.data={CACHE / 'calc_demos.jsonl'}", f"warmstart.steps={steps}", "warmstart.lr=1e-4",
           "warmstart.batch_size=8", "train.progress=false", "warmstart.checkpoint_every=0"]
    print(f"[async_stages] warm start for the calculator task: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, env=_env(2), check=True)


def arm_overrides(arm: str, seed: int, args) -> list[str]:
    preset = "grpo" if arm == "grpo" else "mu-grpo"
    out = [f"train.seed={seed}"]
    if preset == "mu-grpo":
        out.append(f"schedule.num_stages={args.stages}")
    if arm == "async":
        out.append("schedule.async_stages=1")
    return ["--preset", preset, *out]


def listening_url(proc: subprocess.Popen) -> str:
    """The URL a starting ``mugrpo serve`` names in its ``listening on`` line (RuntimeError with its last log
    lines if it exits first); its log is then drained on a thread, so the pipe never fills."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return m.group(1)
    raise RuntimeError(f"mugrpo serve did not start (exit {proc.wait()}):\n{''.join(lines[-30:])}")


class Service:
    """``mugrpo serve --engine ENGINE`` on one core; its URL once it listens."""

    def __init__(self, core: int, model: str, engine: str = "hf"):
        dtype = ["--dtype", "float32"] if engine == "hf" else []  # vLLM: auto, the trainer's rule
        env = {**_env(1), "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        self.proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "mugrpo", "serve", "--engine",
                                      engine, "--model", model, "--port", "0", *dtype],
                                     env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.url = listening_url(self.proc)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_arm(arm: str, seed: int, task: str, args) -> dict:
    run_dir = CACHE / task / f"{arm}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), *arm_overrides(arm, seed, args),
           *task_overrides(task, args)]
    service = None
    if arm in ("async", "sync_split"):
        service = Service(core=1, model=task_model(task), engine=args.engine)
        cmd = ["taskset", "-c", "0", *cmd, "rollout.engine=remote", f"rollout.remote.urls=[{service.url}]"]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=_env(1 if service else 2), capture_output=True, text=True)
    finally:
        if service is not None:
            service.close()
    wall_s = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return {"arm": arm, "seed": seed, "task": task, "process_wall_s": wall_s, **summarize(run_dir)}


def summarize(run_dir: Path) -> dict:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    stages = [r for r in records if r["kind"] == "stage"]
    evals = [r for r in records if r["kind"] == "eval"]
    clock = max(r["time_s"] for r in records)
    if stages and "perf/trainer_idle_frac" in stages[0]:
        walls = [r["perf/stage_wall_s"] for r in stages]
        trainer_idle = sum(r["perf/trainer_idle_frac"] * w for r, w in zip(stages, walls)) / sum(walls)
        engine_idle = sum(r["perf/engine_idle_frac"] * w for r, w in zip(stages, walls)) / sum(walls)
    else:  # synchronous: the trainer waits while the stage is synced, generated and scored
        gen = sum(r.get("perf/sync_s", 0.0) + r.get("perf/generate_s", 0.0) + r.get("perf/score_s", 0.0)
                  for r in stages)
        trainer_idle = gen / clock
        engine_idle = 1.0 - trainer_idle
    last = evals[-1] if evals else {}
    avg = next((v for k, v in last.items() if k.startswith("eval/avg_at_")), None)
    return {"clock_s": clock, "trainer_idle_frac": trainer_idle, "engine_idle_frac": engine_idle,
            "policy_lag_max": max((r.get("stage/policy_lag_max", 0) for r in stages), default=0),
            "policy_lag_mean": (sum(r.get("stage/policy_lag_mean", 0.0) for r in stages) / len(stages)) if stages else 0,
            "generate_s": sum(r.get("perf/generate_s", 0.0) for r in stages),
            "optimize_s": sum(r.get("perf/optimize_s", 0.0) for r in stages),
            "eval_greedy_acc": last.get("eval/greedy_acc"), "eval_avg_at_n": avg,
            "reward_mean_last_stage": stages[-1].get("reward/mean") if stages else None,
            "tool_calls": sum(r.get("env/tool_calls", 0) for r in stages),  # 0 without an environment
            "tool_call_frac": (sum(r.get("env/tool_call_frac") or 0.0 for r in stages) / len(stages)) if stages else 0}


def table(runs: list[dict]) -> dict:
    """Per task and arm: the means over seeds, and the clock as a ratio to the synchronous arm's."""
    out = {}
    for task in sorted({r["task"] for r in runs}):
        arms = {}
        for arm in ARMS:
            mine = [r for r in runs if r["task"] == task and r["arm"] == arm]
            if not mine:
                continue
            def mean(k, mine=mine):
                values = [r[k] for r in mine if r.get(k) is not None]
                return sum(values) / max(1, len(values))
            arms[arm] = {k: mean(k) for k in ("clock_s", "trainer_idle_frac", "engine_idle_frac", "policy_lag_max",
                                               "policy_lag_mean", "eval_greedy_acc", "eval_avg_at_n", "generate_s",
                                               "optimize_s", "tool_calls", "tool_call_frac")}
            arms[arm]["num_seeds"] = len(mine)
        sync = arms.get("sync", {}).get("clock_s")
        for values in arms.values():
            values["clock_vs_sync"] = values["clock_s"] / sync if sync else None
        out[task] = arms
    return out


def figure(result_path: Path, png: Path) -> None:
    """Per arm: the training clock of each seed, split into the trainer's busy and idle time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plotting import finish
    from benchmarks.suite import read_figures

    runs = read_figures(result_path)["runs"]
    tasks = sorted({r.get("task", "default") for r in runs})
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine_task = [r for r in runs if r.get("task", "default") == task]
        arms = [a for a in ARMS if any(r["arm"] == a for r in mine_task)]
        for i, arm in enumerate(arms):
            mine = sorted((r for r in mine_task if r["arm"] == arm), key=lambda r: r["seed"])
            for j, r in enumerate(mine):
                x = i + (j - (len(mine) - 1) / 2) * 0.25
                idle = r["clock_s"] * r["trainer_idle_frac"]
                ax.bar(x, r["clock_s"] - idle, 0.22, color="tab:blue", label="trainer busy" if i == j == 0 else None)
                ax.bar(x, idle, 0.22, bottom=r["clock_s"] - idle, color="tab:orange",
                       label="trainer idle" if i == j == 0 else None)
        ax.set_xticks(range(len(arms)), arms)
        ax.set_ylabel("training clock (s)")
        ax.set_title(f"{task} task: stages generated ahead, in miniature (2 cores; bars: seeds)", fontsize=9)
    finish(fig, list(axes[0]), png)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks async_stages", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("default", "calculator"), default="default")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--stages", type=int, default=4, help="mu-grpo's stages (grpo: its preset, mu = 4)")
    p.add_argument("--prompts", type=int, default=8, help="schedule.prompts_per_update")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-items", type=int, default=32)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="the rollout engine: in process for sync and grpo, the service's for async and sync_split")
    p.add_argument("--append", action="store_true", help="add to the runs already in --out")
    p.add_argument("--figure", action="store_true", help="only draw --out's figure (async_stages.png beside it)")
    common_arguments(p, "async_stages", seeds=[1, 2, 3])
    args = p.parse_args(argv)
    if args.task != "default" and args.out == p.get_default("out"):  # each task its own result file and figure
        args.out = str(Path(args.out).with_name(f"async_stages_{args.task}.json"))
    if args.figure:
        figure(Path(args.out), Path(args.out).with_suffix(".png"))
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.task == "calculator":
        prepare_calculator()
    runs = []
    if args.append and Path(args.out).is_file():
        from benchmarks.suite import read_figures

        runs = read_figures(args.out)["runs"]
    config = {**vars(args), "overrides": task_overrides(args.task, args)}
    for seed in args.seeds:
        for arm in args.arms:
            result = run_arm(arm, seed, args.task, args)
            print(json.dumps(result), flush=True)
            runs.append(result)
            write_result(args.out, "async_stages", {"runs": runs, "table": table(runs)}, config, finished=False)
    write_result(args.out, "async_stages", {"runs": runs, "table": table(runs)}, config)
    print(json.dumps(table(runs), indent=1))
    figure(Path(args.out), Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
