"""``mugrpo sft`` in 2 gloo processes under torchrun (FSDP2) against one process, on CPU.

The warm start shares RL's model side (:func:`mugrpo.kit.model_parts.build_model`, FSDP2 from
:mod:`mugrpo.kit.distributed`); these tests check that it also shares RL's data-parallel
contract: the ranks split each step's examples and make the single process's steps, rank 0 alone
writes (into rank 0's run directory), and a killed 2-process warm start resumes to the
uninterrupted run's weights.

Six demonstrations of distinct lengths (answer i is i + 1 "1" characters, so i + 2 trained tokens
with EOS: 27 in all); 3 a step, 2 epochs: 4 steps. One sequence per micro-batch, so rank 0 (2 of a
step's 3 examples) runs 2 passes and rank 1 one real pass and one filler pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mugrpo.observability.loggers import read_metrics

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]

DEMO_ROWS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "1" * (i + 1)}]}
             for i in range(6)]
NUM_LOSS_TOKENS = sum(i + 2 for i in range(6))  # 27
KEYS = ["train.autocast=none", "train.progress=false", "train.deterministic=true", "train.threads=1",
        "warmstart.batch_size=3", "warmstart.lr=1e-2", "warmstart.epochs=2", "warmstart.checkpoint_every=2",
        "schedule.micro_batch_size=1"]


def _mugrpo(nproc: int, args: list, die_at: str | None = None) -> subprocess.CompletedProcess:
    """``mugrpo sft ...`` in ``nproc`` processes (torchrun when nproc > 1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("MUGRPO_DIE_AT", "MUGRPO_STOP_AT"):
        env.pop(key, None)
    if die_at:
        env["MUGRPO_DIE_AT"] = die_at
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + ["-m", "mugrpo", "sft", *map(str, args)]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)


def _run(nproc: int, run_dir: Path, model_dir: str, demos: Path) -> Path:
    proc = _mugrpo(nproc, ["--run-dir", run_dir, f"model.name={model_dir}", f"warmstart.data={demos}", *KEYS])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return run_dir


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "sft"]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in DEMO_ROWS))
    return path


@pytest.fixture(scope="module")
def two_rank_sft(tmp_path_factory, tiny_model_dir, demos) -> Path:
    return _run(2, tmp_path_factory.mktemp("two") / "run", tiny_model_dir, demos)


@pytest.fixture(scope="module")
def one_rank_sft(tmp_path_factory, tiny_model_dir, demos) -> Path:
    return _run(1, tmp_path_factory.mktemp("one") / "run", tiny_model_dir, demos)


@pytest.mark.slow  # ~30 s
@pytest.mark.distributed
def test_two_processes_make_the_single_process_warm_start(two_rank_sft, one_rank_sft, tiny_model_dir):
    two, one = _steps(two_rank_sft), _steps(one_rank_sft)
    assert [r["update"] for r in two] == [r["update"] for r in one] == [1, 2, 3, 4]  # each step logged once
    # Every demonstration trained once per epoch across the ranks: sft/num_tokens is the trained
    # tokens the ranks' forwards covered, summed over ranks. A rank that trained the whole step, or
    # a share that dropped an example, moves a step's count; steps 1-2 and 3-4 are one epoch each.
    assert [r["sft/num_tokens"] for r in two] == [r["sft/num_tokens"] for r in one]
    assert two[0]["sft/num_tokens"] + two[1]["sft/num_tokens"] == NUM_LOSS_TOKENS
    assert two[2]["sft/num_tokens"] + two[3]["sft/num_tokens"] == NUM_LOSS_TOKENS
    # Tolerance: both sides are fp32 and differ only in summation order (FSDP2's reduce-scatter vs
    # local accumulation, the grad norm summed per shard), a few float32 ulps a step. Measured: losses
    # within 1e-7 relative, grad norms 7e-8, weights 1.3e-7 after 4 AdamW steps of lr 1e-2. A real bug
    # is far outside: a missing x W gradient scale halves the grad norm, a wrong share moves the loss
    # by ~1e-1 (the examples' lengths differ), and the weights move by ~lr a step.
    for a, b in zip(two, one):
        for key in ("sft/loss", "optim/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["update"], key)
    w2, w1, w0 = _weights(two_rank_sft), _weights(one_rank_sft), load_file(f"{tiny_model_dir}/model.safetensors")
    assert w2.keys() == w1.keys() == w0.keys()
    assert max((w2[k] - w0[k]).abs().max().item() for k in w2) > 1e-2  # far above the tolerance below
    for k in w2:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_rank_zero_alone_writes(two_rank_sft, one_rank_sft):
    # The same files as one process: one metrics log, one config, one final model (rank 1 writes
    # only its RNG state into each checkpoint).
    def names(folder):
        return sorted(p.name for p in folder.iterdir() if p.name != ".lock")

    assert names(two_rank_sft) == names(one_rank_sft) == ["checkpoints", "config.yaml", "final_model", "metrics.jsonl",
                                                                 "run.json"]
    assert len(list(two_rank_sft.rglob("metrics*.jsonl"))) == 1
    assert len(list(two_rank_sft.rglob("model.safetensors"))) == 1 + len(list((two_rank_sft / "checkpoints").iterdir()))
    assert names(two_rank_sft / "final_model") == names(one_rank_sft / "final_model")
    assert sorted(p.name for p in (two_rank_sft / "final_model").glob("*.safetensors")) == ["model.safetensors"]
    records = read_metrics(two_rank_sft / "metrics.jsonl")
    assert [r["kind"] for r in records].count("sft_data") == 1
    assert [r for r in records if r["kind"] == "sft_data"][0]["num_loss_tokens"] == NUM_LOSS_TOKENS


@pytest.mark.distributed
@pytest.mark.slow  # ~18 s
def test_killed_two_process_warm_start_resumes_to_the_uninterrupted_weights(two_rank_sft, tiny_model_dir, demos,
                                                                            tmp_path):
    # Killed after step 3, i.e. after the checkpoint of step 2: the resume scatters the full weights
    # and optimizer state back into the shards and makes steps 3 and 4 again.
    run_dir = tmp_path / "run"
    killed = _mugrpo(2, ["--run-dir", run_dir, f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *KEYS],
                     die_at="sft_step:3")
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert not (run_dir / "final_model").exists()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["ckpt_000002_s000_u00002"]
    resumed = _mugrpo(2, ["--resume", run_dir])
    assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}\n{resumed.stderr[-6000:]}"
    got, ref = _steps(run_dir), _steps(two_rank_sft)
    assert [r["update"] for r in got] == [1, 2, 3, 4]
    # Same processes, seeds and CPU kernels: measured bitwise equal; the tolerance only forgives a
    # summation order that gloo might change.
    assert [r["sft/loss"] for r in got] == pytest.approx([r["sft/loss"] for r in ref], rel=1e-6)
    again, uninterrupted = _weights(run_dir), _weights(two_rank_sft)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-6)
    assert [r["kind"] for r in read_metrics(run_dir / "metrics.jsonl")].count("sft_data") == 1


@pytest.mark.slow  # ~19 s
@pytest.mark.distributed
def test_every_rank_writes_into_rank_zeros_run_directory(tiny_model_dir, demos, tmp_path):
    # `mugrpo sft` without --run-dir names the run by the time (runs/sft-<time>), which two processes
    # may read a second apart; the phase takes rank 0's folder. Here each rank asks for its own.
    script = tmp_path / "per_rank.py"
    script.write_text("import os, sys\nfrom mugrpo.config import load_config\nfrom mugrpo.warmstart.phase import sft\n"
                      "sft(load_config(overrides=sys.argv[2:]), f\"{sys.argv[1]}/rank{os.environ['RANK']}\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path / "runs"), f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *KEYS,
           "warmstart.steps=2"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["rank0"]
    assert [r["update"] for r in _steps(tmp_path / "runs" / "rank0")] == [1, 2]


@pytest.mark.distributed
@pytest.mark.slow  # ~20 s; tests/kit/test_distributed.py keeps RL's case
def test_a_stop_one_rank_receives_stops_every_rank_at_the_same_step(two_rank_sft, tiny_model_dir, demos, tmp_path):
    # SIGTERM reaches rank 1 alone, after step 1: the ranks agree (a max over ranks) to checkpoint
    # and stop after that step. A rank checkpointing alone would wait in the checkpoint's gathers
    # while the other ran step 2's, until parallel.timeout_s (set short, so a bug fails, not hangs).
    script = tmp_path / "stop_rank1.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    os.environ['MUGRPO_STOP_AT'] = 'sft_step:1'\n"
                      "from mugrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "sft",
           "--run-dir", str(run_dir), f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *KEYS,
           "parallel.timeout_s=60"]
    stopped = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert stopped.returncode != 0 and "exitcode  : 130" in stopped.stderr, stopped.stderr[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["ckpt_000001_s000_u00001"]
    resumed = _mugrpo(2, ["--resume", run_dir])
    assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}\n{resumed.stderr[-6000:]}"
    for name, value in _weights(two_rank_sft).items():
        torch.testing.assert_close(_weights(run_dir)[name], value, rtol=0, atol=1e-6)
