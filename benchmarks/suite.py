"""The benchmark suite: the registry, the common arguments and the one result schema.

cleanrl runs every benchmark through one harness and torchtitan fixes one report schema; this module
does both for mugrpo's benchmarks:

- :data:`REGISTRY`: name -> :class:`Benchmark` (its ``module:function`` or shell script, a one-line
  description, its default result file). ``python -m benchmarks`` lists it and
  ``python -m benchmarks NAME ARGS...`` runs one (:mod:`benchmarks.__main__`).
- :func:`common_arguments`: ``--out``, ``--seeds`` and ``--quick``, declared once for every benchmark.
- :func:`write_result` / :func:`read_result`: the schema (``SCHEMA``) every result file is written in::

    {"schema": 1, "benchmark": NAME,
     "machine": {"cpu_capability", "cores", "load_avg" (at start), "load_avg_end", "torch", "platform", "python"},
     "commit": {"sha", "dirty", "source"}, "command": [argv...], "config": {the benchmark's arguments},
     "figures": {what the benchmark measured}, "started": ISO time, "finished": ISO time or null (still running)}

The commit is the checkout's at the process's start (a long run's tree may change under it), read
with git; where there is no git (a copy of the tree on another machine) ``MUGRPO_BENCH_COMMIT=SHA``
(``SHA+dirty`` for a changed tree) names it, and without either a result is refused at the start
(:func:`require_commit`), not after the run. ``commit.source`` says which.

Results from before the schema were wrapped in it with what they had recorded; fields they did not
record say ``"unknown"`` (:func:`legacy_envelope`), and their commit was recovered from git history
(``commit.source`` says so). A result that cannot be re-run or converted lives in
``benchmarks/results/legacy/``, outside the suite's checks. Importing this module loads no torch, so
listing the suite is instant; :func:`machine` imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = 1
UNKNOWN = "unknown"
STARTED = time.strftime("%Y-%m-%dT%H:%M:%S%z")  # this process's start (the harness imports this module first)
LOAD_AT_START = list(os.getloadavg())


@dataclass(frozen=True)
class Benchmark:
    """One registered benchmark: ``target`` is ``package.module:function`` (called with the argument
    list) or a shell script's path; ``out`` its default result file or folder (None: it writes none)."""
    target: str
    description: str
    out: str | None = None

    @property
    def is_shell(self) -> bool:
        return self.target.endswith(".sh")


def _r(name: str) -> str:
    return f"benchmarks/results/{name}"


REGISTRY: dict[str, Benchmark] = {
    "async_stages": Benchmark("benchmarks.async_stages:main",
                              "the async table in miniature: stages generated ahead against one rollout service",
                              _r("async_stages.json")),
    "call_isolation": Benchmark("benchmarks.call_isolation:main",
                                "what a tool call costs under thread and process isolation, and a timeout",
                                _r("call_isolation.json")),
    "efficiency": Benchmark("benchmarks.efficiency:main",
                            "the default job end to end, an update, memory: an earlier commit against this tree",
                            _r("efficiency.json")),
    "env_calculator": Benchmark("benchmarks.env_calculator:main",
                                "SmolLM2 with a calculator tool: tool use, accuracy, mu-grpo vs grpo, memory",
                                _r("env_calculator.json")),
    "env_tool_call_rate": Benchmark("benchmarks.env_tool_call_rate:main",
                                    "does the untrained SmolLM2 call the calculator tool? (rate at step 0)",
                                    _r("env_tool_call_rate.json")),
    "gpu_fsdp_check": Benchmark("benchmarks.gpu_fsdp_check:main",
                                "GPU check of the FSDP2 path: tokens/s, MFU, peak memory (not yet run on a GPU)",
                                _r("gpu_fsdp_check.json")),
    "lora": Benchmark("benchmarks.lora:main",
                      "LoRA against full fine-tuning on SmolLM2: seconds per update, peak memory, sync cost",
                      _r("lora.json")),
    "memory": Benchmark("benchmarks.memory:main",
                        "the default job's peak resident memory (whole process tree), by phase, and its learning",
                        _r("memory.json")),
    "multiturn_env_pool": Benchmark("benchmarks.multiturn_env_pool:main",
                                    "a slow environment in the multi-turn loop: serial steps against the pool",
                                    _r("multiturn_env_pool.json")),
    "same_result": Benchmark("benchmarks/same_result.sh",
                             "does this checkout train bitwise as an earlier commit does? (metrics, weights)"),
    "serving": Benchmark("benchmarks.serving:main",
                         "rollouts on vLLM's own server: a stage before/after, lock-step vs independent agents",
                         _r("serving_stage.json")),
    "smollm": Benchmark("benchmarks.smollm.run:main",
                        "SmolLM2 on the default task: grpo vs mu-grpo vs TRL (--size smoke|default|full)",
                        _r("smollm_smoke.json")),
    "smollm_corrections": Benchmark("benchmarks.smollm.corrections:main",
                                    "SmolLM2: the off-policy corrections on identical stale rollouts",
                                    _r("smollm_corrections.json")),
    "smollm_long_cot": Benchmark("benchmarks.smollm.long_cot:main",
                                 "SmolLM2 on long worked answers at high staleness: grpo vs relaxed vs mu-grpo",
                                 _r("smollm_long_cot.json")),
    "smollm_tool_rl": Benchmark("benchmarks.smollm.tool_rl:main",
                                "SmolLM2 warm-started on calculator traces, then RL with the tool",
                                _r("smollm_tool_rl/tool_rl.json")),
    "smollm_tool_warmstart": Benchmark("benchmarks/smollm/tool_warmstart.sh",
                                       "a warm start on solved traces makes SmolLM2 call the calculator",
                                       _r("smollm_tool_warmstart/result.json")),
    "stop_latency": Benchmark("benchmarks.stop_latency:main",
                              "seconds from a SIGTERM during generation to the run's exit",
                              _r("stop_latency.json")),
    "tis": Benchmark("benchmarks.tis:main",
                     "engine-vs-trainer log-prob mismatch on the default job, TIS off and on",
                     _r("tis.json")),
    "toy_lab": Benchmark("benchmarks.toy_lab.run:main",
                         "toy lab: the paper's staleness experiments on a ~1M-parameter char model",
                         _r("toy_lab.json")),
    "toy_lab_corrections": Benchmark("benchmarks.toy_lab.corrections:main",
                                     "toy lab: the off-policy corrections on identical stale rollouts",
                                     _r("toy_lab_corrections.json")),
    "toy_lab_dynamic": Benchmark("benchmarks.toy_lab.dynamic:main",
                                 "toy lab: dynamic sampling on a task the model mostly fails",
                                 _r("toy_lab_dynamic.json")),
    "toy_lab_plot": Benchmark("benchmarks.toy_lab.plot:main",
                              "toy lab: redraw the figures and the summary table from a results file"),
    "toy_lab_plot_corrections": Benchmark("benchmarks.toy_lab.plot_corrections:main",
                                          "toy lab: redraw the corrections figure and table from its results"),
    "toy_lab_plot_long": Benchmark("benchmarks.toy_lab.plot_long:main",
                                   "toy lab, long answers: redraw the figures and tables from its results"),
    "toy_lab_rollout_phase": Benchmark("benchmarks.toy_lab.rollout_phase:main",
                                       "toy lab, long answers: one whole stage against grpo's small refreshes",
                                       _r("toy_lab_long_rollout.json")),
    "toy_lab_triggers": Benchmark("benchmarks.toy_lab.triggers:main",
                                  "toy lab, long answers: which tokens trigger the veto, offline",
                                  _r("toy_lab_long_triggers.json")),
    "vllm_engine": Benchmark("benchmarks.vllm_engine:main",
                             "the vLLM rollout engine: tokens/s, start-up, weight sync, against raw vLLM and HF",
                             _r("vllm_engine.json")),
}


def common_arguments(parser: argparse.ArgumentParser, name: str, *, out: str | None = None,
                     seeds: list[int] | None = None, quick: str | None = None) -> None:
    """Add the suite's common arguments to ``parser``: ``--out`` (default: the registered result file,
    or ``out``), ``--seeds`` (only where ``seeds`` gives the default list) and ``--quick`` (only where
    ``quick`` says what it shrinks)."""
    default = out if out is not None else REGISTRY[name].out
    parser.add_argument("--out", default=str(ROOT / default) if default else None,
                        help=f"result file (default {default})")
    if seeds is not None:
        parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds), help=f"default {seeds}")
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")


COMMIT_ENV = "MUGRPO_BENCH_COMMIT"
SHA = re.compile(r"[0-9a-f]{40}")


def _read_commit() -> dict:
    """The checkout's commit and whether the tree differs from it (tracked or untracked files), from
    git, else from ``MUGRPO_BENCH_COMMIT``; ``unknown`` with neither."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    try:
        return {"sha": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain").strip()),
                "source": "git"}
    except (OSError, subprocess.CalledProcessError):
        pass
    given = os.environ.get(COMMIT_ENV, "")
    sha, _, flag = given.partition("+")
    if SHA.fullmatch(sha) and flag in ("", "dirty"):
        return {"sha": sha, "dirty": flag == "dirty", "source": COMMIT_ENV}
    return {"sha": UNKNOWN, "dirty": UNKNOWN, "source": UNKNOWN}


_COMMIT: dict | None = None


def commit() -> dict:
    """The commit this process started from (read once, at the first call: the harness calls
    :func:`require_commit` before the benchmark runs)."""
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = _read_commit()
    return dict(_COMMIT)


def require_commit() -> dict:
    """The start's commit, or an error saying how to name it: a result must say what it measured."""
    found = commit()
    if found["sha"] == UNKNOWN:
        given = os.environ.get(COMMIT_ENV)
        raise SystemExit(f"benchmarks: cannot tell which commit this tree is ({ROOT} is not a git checkout"
                         + (f", and {COMMIT_ENV}={given!r} is not a 40-hex sha, optionally +dirty" if given else "")
                         + f"); run from a git checkout, or set {COMMIT_ENV}=SHA (SHA+dirty if the tree differs)")
    return found


def worktree(commit: str, work: Path) -> Path:
    """A detached checkout of ``commit`` at ``work/tree-COMMIT`` (made once), to run another commit's code."""
    path = work / f"tree-{commit}"
    if not (path / "mugrpo").is_dir():  # not made yet, or left half made
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def machine(**extra) -> dict:
    """The machine the numbers came from; ``extra`` adds what one benchmark needs (threads, a GPU)."""
    import torch

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "load_avg": LOAD_AT_START, "load_avg_end": list(os.getloadavg()), "torch": torch.__version__,
            "platform": platform.platform(), "python": platform.python_version(), **extra}


def command() -> list[str]:
    """How this process was started, as a command to type from the repository root."""
    argv0 = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    if argv0 and argv0.suffix == ".py" and argv0.is_relative_to(ROOT):
        module = ".".join(argv0.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")
        return ["python", "-m", module, *sys.argv[1:]]
    return ["python", *sys.argv]


def _plain(value):
    """argparse namespaces and paths as JSON."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def envelope(name: str, figures: dict, config, *, finished: bool = True, argv: list[str] | None = None,
             **machine_extra) -> dict:
    """The schema around ``figures``: machine, commit, command (``argv``, else this process's), config, times."""
    return {"schema": SCHEMA, "benchmark": name, "machine": machine(**machine_extra), "commit": require_commit(),
            "command": argv or command(), "config": _plain(config), "figures": figures, "started": STARTED,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z") if finished else None}


def write_result(path, name: str, figures: dict, config, *, finished: bool = True, indent: int | None = 1,
                 argv: list[str] | None = None, **machine_extra) -> Path:
    """Write ``figures`` in the schema to ``path`` (atomically: a killed run keeps the previous file).
    ``finished=False`` for a partial write that the same run will rewrite; ``argv`` for a command that
    is not this process's (a shell benchmark)."""
    if name not in REGISTRY:
        raise KeyError(f"benchmark {name!r} is not registered in benchmarks/suite.py REGISTRY")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = envelope(name, figures, config, finished=finished, argv=argv, **machine_extra)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=indent, default=str, separators=None if indent else (",", ":")) + "\n")
    tmp.replace(path)
    return path


def wrap_file(path, name: str, argv: list[str]) -> Path:
    """Put a JSON file another program wrote (a ``mugrpo eval`` report a benchmark asked for) into the
    schema, in place: its content becomes the figures, its ``settings`` (if any) the config."""
    data = json.loads(Path(path).read_text())
    config = data.get("settings", {}) if isinstance(data, dict) else {}
    return write_result(path, name, data, config, argv=argv)


def read_stage_data(stage_dir):
    """A finished stage of a run, every shard, read through mugrpo's one verified reader
    (:func:`mugrpo.stages.shards.load_stage_shards`: the marker, the checksums, the shard names)."""
    from mugrpo.kit.distributed import World
    from mugrpo.stages.shards import load_stage_shards

    data = load_stage_shards(Path(stage_dir), World())
    if data is None:
        raise SystemExit(f"{stage_dir}: the stage is not complete (no shards.json); pick a run whose stage finished")
    return data


def read_result(path) -> dict:
    """A result file in the schema. A file from before it is wrapped as :func:`legacy_envelope` does."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and data.get("schema") == SCHEMA:
        return data
    return legacy_envelope(Path(path).stem, data)


def read_figures(path) -> dict:
    """Only the figures of a result file (a benchmark's own report reads these)."""
    return read_result(path)["figures"]


def _find(data, *keys):
    """The first value under any of ``keys``, searched depth-first through dicts (old files put the
    machine in many shapes: machine.cpu_capability, cpu_capability at the top, settings.machine...)."""
    if isinstance(data, dict):
        for k in keys:
            if k in data:
                return data[k]
        for v in data.values():
            found = _find(v, *keys)
            if found is not None:
                return found
    return None


def legacy_envelope(name: str, figures, committed_in: str = UNKNOWN) -> dict:
    """The schema around a result written before it: what the file recorded, ``unknown`` elsewhere."""
    def known(*keys):
        v = _find(figures, *keys)
        return UNKNOWN if v is None else v

    def top(*keys):  # only the file's own top level: a run's command inside it is not the benchmark's
        return next((figures[k] for k in keys if isinstance(figures, dict) and k in figures), UNKNOWN)
    return {"schema": SCHEMA, "benchmark": name,
            "machine": {"cpu_capability": known("cpu_capability"), "cores": known("cores", "cpus", "cpu_count"),
                        "load_avg": known("load_avg", "loadavg", "loadavg_start", "load_average_start"),
                        "torch": known("torch"), "platform": UNKNOWN, "python": known("python")},
            "commit": {"sha": UNKNOWN, "dirty": UNKNOWN, "source": UNKNOWN, "committed_in": committed_in},
            "command": top("command", "argv"), "config": top("settings", "config", "sizing"),
            "figures": figures, "started": UNKNOWN, "finished": UNKNOWN,
            "note": "written before the result schema; machine, commit and config as far as the file recorded them"}
