"""Engine-vs-trainer log-prob mismatch on the SmolLM default job (vLLM bf16), TIS off and on.

Two shortened default jobs from the same seed, one with ``loss.behavior_logprobs=engine`` (the
paper's default: the ratio against vLLM's stored log-probs) and one with ``=trainer`` (the trainer
recomputes them, ratio against those, TIS weight min(pi_trainer / pi_engine, C)). Per stage it
reports what the loss sees at the stage's first update (the ratio should be 1: same weights), the
stage-level mismatch metrics of the ``trainer`` run, and, for the ``engine`` run, the same mismatch
metrics computed afterwards over its stage-0 data with the initial model (the stage-0 behaviour
weights, in the trainer's precision), so both runs have a whole-stage number. Results, with the
CPU capability, go to ``benchmarks/results/tis.json``; docs/benchmarks/tis.md (section 5) reads them.

    PYTHONPATH=. nice .venv-vllm/bin/python -m benchmarks tis            # both runs, then the summary
    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks tis --summarize [--offline]  # re-read the run dirs
    (``--modes engine`` / ``--modes trainer`` make one run each; a killed run resumes with
    ``mugrpo train --resume benchmarks/cache/tis/MODE``)

On 2 cores shared with other jobs (load ~17) a run took 25-40 min. Two vLLM runs at once need about
7 GB of memory each: on a 24 GB machine shared with others they were OOM-killed, so run them one
after the other.

The job is shortened (``schedule.total_updates=8 schedule.num_stages=2``, evaluation off, no final
model): the mismatch is a per-token property of the two forwards and does not depend on run length.
Benchmarks report; they never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.suite import common_arguments, read_figures, read_stage_data, write_result

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "cache" / "tis"
SHORT = ["rollout.engine=vllm", "rollout.dtype=bfloat16", "schedule.total_updates=8", "schedule.num_stages=2",
         "eval.every_stages=0", "eval.at_start=false", "train.save_final_model=false", "train.progress=false"]
MODES = ("engine", "trainer")
FIRST_UPDATE_KEYS = ("loss/log_ratio_abs_mean", "loss/kl_behavior", "loss/ratio_mean", "loss/clip_frac_low",
                     "loss/clip_frac_high", "loss/trigger_frac", "loss/veto_token_frac", "loss/policy")


def run_job(mode: str, extra: list[str]) -> float:
    run_dir = WORK / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), *SHORT,
           f"loss.behavior_logprobs={mode}", *extra]
    print("[tis]", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    return time.perf_counter() - t


def offline_mismatch(run_dir: Path) -> dict:
    """The engine run's stage 0: recompute its behaviour log-probs with the initial model, as the
    ``trainer`` mode would have at that stage's start, and take the same metrics."""
    from mugrpo.stages import tis
    from mugrpo.training.trainer import step_settings
    from mugrpo.kit.lifecycle import resume_config
    from mugrpo.run_dir import RunDir
    from mugrpo.kit.distributed import World
    from mugrpo.hardware import detect, resolve
    from mugrpo.models.loading import load_policy, resolve_model_path

    cfg = resume_config(run_dir, [])
    policy = load_policy(resolve_model_path(cfg.model.name, cfg.model.cache_dir), cfg.model.trust_remote_code)
    resolved = resolve(cfg.train.autocast, cfg.rollout.dtype, cfg.rollout.engine, detect())
    data = read_stage_data(RunDir(run_dir).stage(0))
    t = time.perf_counter()
    data = tis.recompute_trainer_logprobs(policy, data, step_settings(cfg, resolved), torch.device("cpu"))
    seconds = time.perf_counter() - t
    trainer_cfg = cfg
    trainer_cfg.loss.behavior_logprobs = "trainer"
    return {**tis.stage_metrics(data, step_settings(trainer_cfg, resolved), World(), RunDir(run_dir).stage(0)), "perf/recompute_s": seconds,
            "trainer_precision": resolved.autocast}


def layout_sensitivity(run_dir: Path, num_groups: int = 3) -> dict:
    """Mean |log-prob difference| of the trainer's own forward between two micro-batch layouts of the
    same sequences and weights (shared-prefix rows packed to 1024 tokens vs one sequence per
    micro-batch), in bf16 autocast and in float32: why a stage's first update sees |log rho| > 0
    even against the trainer's own recompute."""
    from mugrpo.kit.batching import micro_batches, sequences_to_train
    from mugrpo.kit.lifecycle import resume_config
    from mugrpo.run_dir import RunDir
    from mugrpo.kit.batching import collate
    from mugrpo.kit.forward import response_logprobs, shared_prefix_support
    from mugrpo.models.loading import load_policy, resolve_model_path

    cfg = resume_config(run_dir, [])
    policy = load_policy(resolve_model_path(cfg.model.name, cfg.model.cache_dir), cfg.model.trust_remote_code)
    data = read_stage_data(RunDir(run_dir).stage(0))
    seqs = sequences_to_train(data, list(range(num_groups * data.group_size)), True)
    _, mask_dtype, _ = shared_prefix_support(policy)
    out = {"num_sequences": len(seqs)}
    for name, autocast in (("bf16", True), ("float32", False)):
        packed = {}
        with torch.no_grad():
            for mb in micro_batches(data, seqs, shared=True, budget=1024, max_seqs=None, pad_id=0,
                                    mask_dtype=mask_dtype):
                lp, _ = response_logprobs(policy, mb, cfg.rollout.temperature, autocast, False, False)
                for row in range(lp.shape[0]):  # identify each row by its response tokens
                    n = int(mb.response_mask[row].sum())
                    packed[tuple(mb.response_ids[row, :n].tolist())] = lp[row, :n]
            diffs = []
            for s in seqs:
                lp, _ = response_logprobs(policy, collate(data, [s], 0), cfg.rollout.temperature, autocast, False,
                                          False)
                diffs.append((lp[0] - packed[tuple(data.responses[s])]).abs())
        out[f"{name}_abs_diff_mean"] = float(torch.cat(diffs).mean())
        out[f"{name}_abs_diff_max"] = float(torch.cat(diffs).max())
    return out


def stored_mismatch(run_dir: Path) -> dict:
    """The ``trainer`` run's mismatch metrics per stage, from the trainer log-probs stored in its shards
    (the same numbers as its stage lines; available as soon as a stage is generated)."""
    from mugrpo.stages import tis
    from mugrpo.training.trainer import step_settings
    from mugrpo.kit.lifecycle import resume_config
    from mugrpo.stages.shards import is_complete
    from mugrpo.kit.distributed import World

    cfg = resume_config(run_dir, [])
    out = {}
    for folder in sorted((run_dir / "stages").glob("stage_*")):
        if is_complete(folder):
            data = read_stage_data(folder)
            out[int(folder.name.split("_")[1])] = tis.stage_metrics(data, step_settings(cfg), World(), folder)
    return out


def summarize(seconds: dict) -> dict:
    from mugrpo.observability.loggers import read_metrics

    out = {"overrides": SHORT, "runs": {}}
    for mode in MODES:
        records = read_metrics(WORK / mode / "metrics.jsonl")
        stages = {}
        for r in records:
            if r["kind"] == "update" and r["update_in_stage"] == 0:
                stages.setdefault(r["stage"], {})["first_update"] = {k: r.get(k) for k in FIRST_UPDATE_KEYS}
            if r["kind"] == "stage":
                stages.setdefault(r["stage"], {})["stage"] = {k: v for k, v in r.items() if k.startswith(
                    ("stage/", "reward/mean", "perf/recompute_s", "perf/generate_s", "perf/optimize_s"))}
        out["runs"][mode] = {"wall_s": seconds.get(mode, records[-1]["time_s"]), "stages": stages}
    out["runs"]["trainer"]["stored_mismatch"] = stored_mismatch(WORK / "trainer")
    return out


def offline(previous: dict) -> dict:
    """The two analyses that run SmolLM forwards again (minutes on a busy machine)."""
    out = dict(previous)
    out["engine_stage0_offline_recompute"] = offline_mismatch(WORK / "engine")
    out["trainer_forward_layout_sensitivity"] = layout_sensitivity(WORK / "trainer")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser, "tis")
    parser.add_argument("--summarize", action="store_true", help="only re-read the two finished run dirs")
    parser.add_argument("--offline", action="store_true", help="with --summarize: also (re)compute the offline "
                        "analyses (engine stage-0 recompute, layout sensitivity); otherwise kept from tis.json")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="which runs to make (then --summarize once both are done)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both runs")
    args = parser.parse_args(argv)
    seconds = {}
    if not args.summarize:
        for mode in args.modes:
            seconds[mode] = run_job(mode, args.overrides)
        if set(args.modes) != set(MODES):
            return
    result = summarize(seconds)
    out = Path(args.out)
    previous = read_figures(out).get("offline", {}) if out.is_file() else {}
    result["offline"] = offline(previous) if args.offline or not args.summarize else previous
    from mugrpo.hardware import detect

    write_result(out, "tis", result, args, native_bf16=detect().native_bf16)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
