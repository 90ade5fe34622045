"""Multi-process training: 2 gloo processes under torchrun against one process, on CPU.

The torchrun tests (marker ``distributed``) launch ``python -m torch.distributed.run`` in a
subprocess on the ~0.1M-parameter Llama built in code, with the reward that counts "1" characters
(``toy_rewards:frac_ones``). The first tests are plain functions of the stage-data split.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.kit import distributed as dist
from mugrpo.run_dir import SHARDS_FILE, shard_path
from mugrpo.stages import shards
from mugrpo.stages.data import StageData
from mugrpo.kit.order import update_groups

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]

COMMON = [*TINY_OVERRIDES, "task.size=256", "task.eval_size=0", "rollout.group_size=4",
          "schedule.prompts_per_update=8", "optim.lr=3e-3"]


# ---------------------------------------------------------------------------------------------
# The split of a stage's data over ranks (no processes launched).


def _stage(num_groups: int, group_size: int = 2, first_item: int = 0) -> StageData:
    n = num_groups * group_size
    return StageData(prompts=[[1, 2]] * num_groups, responses=[[3]] * n, behavior_logprobs=[[-1.0]] * n,
                     rewards=torch.zeros(n), advantages=torch.zeros(n), finished=torch.ones(n, dtype=torch.bool),
                     item_indices=list(range(first_item, first_item + num_groups)), group_size=group_size)


def test_generation_share_keeps_groups_whole_and_covers_the_stage():
    indices = list(range(10))
    shares = [dist.generation_share(indices, dist.World(rank=r, size=2)) for r in range(2)]
    assert shares == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


def test_one_process_holding_both_shards_draws_the_union_of_the_two_ranks_minibatches(tmp_path):
    # Shard 0 holds items 0..5, shard 1 items 100..105 (6 groups each). P = 4 prompts per update,
    # so each shard gives P / S = 2 groups to every update, whoever holds it.
    for shard, first in ((0, 0), (1, 100)):
        _stage(6, first_item=first).save(shard_path(tmp_path, shard))
    (tmp_path / SHARDS_FILE).write_text(json.dumps({"num_shards": 2, "num_groups": [6, 6]}))
    both = shards.load_stage_shards(tmp_path, dist.World())
    assert both.shard_sizes == [6, 6] and both.num_groups == 12
    for update in range(5):  # 5 updates x 2 groups > 6: crosses into the second pass
        one = [both.item_indices[g] for g in shards.rank_update_groups(both, 4, update, seed=3, stage=1)]
        per_rank = []
        for rank in range(2):
            shard = StageData.load(shard_path(tmp_path, rank))
            per_rank += [shard.item_indices[g] for g in shards.rank_update_groups(shard, 2, update, seed=3, stage=1)]
        assert one == per_rank
        assert one[:2] == update_groups(6, 2, update, 3, 1)  # shard 0's draw is the plain one


def test_a_stage_is_loaded_only_once_every_shard_is_written(tmp_path):
    # Rank 0 had saved its shard when generation died: no shards.json, so the stage is generated
    # again by every rank (loading on some ranks and generating on others would deadlock).
    _stage(4).save(shard_path(tmp_path, 0))
    assert shards.load_stage_shards(tmp_path, dist.World()) is None
    _stage(4).save(shard_path(tmp_path, 1))
    (tmp_path / SHARDS_FILE).write_text(json.dumps({"num_shards": 2, "num_groups": [4, 4]}))
    assert shards.load_stage_shards(tmp_path, dist.World()).num_groups == 8
    with pytest.raises(ValueError, match="divides 2"):  # 2 shards cannot be split over 3 ranks
        shards.load_stage_shards(tmp_path, dist.World(rank=0, size=3))


def test_optimizer_state_by_name_round_trips_and_saving_creates_no_state():
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(model, optimizer):
        model(torch.ones(5, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = make()
    # torch.distributed.checkpoint's get_optimizer_state_dict would run a zero-lr step() here to
    # create the state, moving Adam's step count; saving must leave a fresh optimizer untouched.
    assert dist.full_optimizer_state(model, optimizer, keep=True)["state"] == {} and not optimizer.state
    step(model, optimizer)
    step(model, optimizer)
    saved = dist.full_optimizer_state(model, optimizer, keep=True)
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert float(saved["state"]["0.weight"]["step"]) == 2
    assert dist.full_optimizer_state(model, optimizer, keep=False) is None

    other, other_optimizer = make()
    other.load_state_dict(model.state_dict())
    dist.load_full_optimizer_state(other, other_optimizer, saved)
    step(model, optimizer)
    step(other, other_optimizer)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# torchrun.


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir) -> Path:
    return Path(tiny_model_dir)


def _mugrpo(nproc: int, args: list[str], timeout_s: float = 240) -> None:
    """Run ``mugrpo train ...`` in ``nproc`` processes (torchrun when nproc > 1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc > 1 else [sys.executable]) + ["-m", "mugrpo", "train", *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, tmp_path_factory) -> Path:
    """16 updates in 4 stages by 2 ranks: micro-batches of at most 8 sequences (zero-advantage ones
    skipped, so the ranks' counts differ and filler passes run), the post-veto normaliser (its extra
    forward is a collective too), gradient clipping active (every norm is 0.6-1.4 > 0.2), activation
    checkpointing on, every checkpoint kept."""
    run = tmp_path_factory.mktemp("two") / "run"
    _mugrpo(2, ["--run-dir", str(run), f"model.name={tiny_model}", *COMMON, "schedule.total_updates=16",
                "schedule.num_stages=4", "schedule.micro_batch_size=8", "optim.max_grad_norm=0.2",
                "loss.veto_normalizer=post_veto", "parallel.activation_checkpointing=true", "checkpoint.keep_last=5"])
    return run


def _resume_copy(run: Path, target: Path, checkpoint: str | None, skip_stages: tuple[str, ...] = ()) -> Path:
    """A run directory holding ``run``'s config, stage data and one of its checkpoints (None: none,
    so the resume starts from the initial weights, a pure function of the config)."""
    target.mkdir()
    shutil.copy(run / "config.yaml", target / "config.yaml")
    shutil.copytree(run / "stages", target / "stages", ignore=shutil.ignore_patterns(*skip_stages))
    if checkpoint is not None:
        shutil.copytree(run / "checkpoints" / checkpoint, target / "checkpoints" / checkpoint)
    return target


@pytest.mark.distributed
def test_two_processes_make_the_same_updates_as_one_process_on_the_same_stage_data(two_rank_run, tiny_model,
                                                                                  tmp_path):
    # ONE process resumes the 2-rank run from its start (no checkpoint: the initial weights). Every
    # stage's data is on disk as 2 shards, so it generates nothing: it reads both shards of each
    # stage, must draw the same minibatches, and make the same 16 updates.
    one = _resume_copy(two_rank_run, tmp_path / "one", None)
    _mugrpo(1, ["--resume", str(one), "parallel.activation_checkpointing=false"])

    # Tolerance: both sides are fp32; they differ only in summation order (gradient reduce-scatter
    # vs local accumulation; the global gradient norm summed per shard vs per tensor), i.e. a few
    # float32 ulps (~1e-7 relative) per step. Measured: update 1 bitwise equal; afterwards losses
    # differ by <= 3e-8 absolute, grad norms by ~2e-7 relative, and parameters by <= 4e-7 after 16
    # AdamW steps of lr 3e-3. A real bug is far outside: a missing x W gradient scale doubles or
    # halves the grad norm; a wrong minibatch or a rank's gradient missing moves a loss by ~1e-2 and
    # parameters by ~lr = 3e-3 per update (they move up to ~5e-2 in total here).
    updates_two, updates_one = _records(two_rank_run, "update"), _records(one, "update")
    assert [r["update"] for r in updates_two] == [r["update"] for r in updates_one] == list(range(1, 17))
    # The zero-advantage skip ran under FSDP2 (ranks then hold different numbers of micro-batches
    # and pad with filler passes), and still matched the single process.
    assert any(r["loss/trained_seq_frac"] < 1 for r in updates_two)
    for a, b in zip(updates_two, updates_one):
        assert a["loss/num_tokens"] == b["loss/num_tokens"]  # the same sequences
        for key in ("loss/total", "loss/policy", "optim/grad_norm", "loss/ratio_mean", "loss/kl_behavior"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["update"], key)
    w2, w1, w0 = _weights(two_rank_run), _weights(one), load_file(str(tiny_model / "model.safetensors"))
    assert set(w2) == set(w1)
    assert max((w2[k] - w0[k]).abs().max().item() for k in w2) > 1e-2  # far above the tolerance below
    for k in w2:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5)


@pytest.mark.slow  # ~22 s
@pytest.mark.distributed
def test_two_process_run_learns_exports_one_hf_folder_and_resumes(two_rank_run, tmp_path):
    from transformers import AutoModelForCausalLM

    stages = _records(two_rank_run, "stage")
    rewards = [r["reward/mean"] for r in stages]
    # Measured: 0.015 -> 0.20 over 4 stages of 4 updates (stage 0 samples the initial policy).
    assert len(rewards) == 4 and rewards[-1] > rewards[0] + 0.05, rewards
    assert stages[0]["stage/num_sequences"] == 32 * 4  # both ranks' shards counted

    final = two_rank_run / "final_model"
    assert sorted(p.name for p in final.glob("*.safetensors")) == ["model.safetensors"]
    assert json.loads((final / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = dict(AutoModelForCausalLM.from_pretrained(final).named_parameters())
    for name, value in _weights(two_rank_run).items():
        assert torch.equal(loaded[name].detach(), value), name

    # Resume with 2 processes from the checkpoint at the start of stage 3, that stage's data
    # deleted: weights are scattered back into the shards, synced to the engines, and stage 3 is
    # generated again. Same processes, seeds and CPU kernels: expected bitwise equal (measured).
    resumed = _resume_copy(two_rank_run, tmp_path / "resumed", "ckpt_000012_s003_u00000", ("stage_003",))
    _mugrpo(2, ["--resume", str(resumed)])
    assert _records(resumed, "stage")[-1]["reward/mean"] == rewards[-1]
    uninterrupted, again = _weights(two_rank_run), _weights(resumed)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-6)


@pytest.mark.slow  # ~41 s; tests/kit/test_distributed.py's learning run resumes across ranks in the default tier
@pytest.mark.distributed
def test_a_stop_one_rank_receives_stops_every_rank_after_the_same_update(two_rank_run, tmp_path):
    # Resumed at the start of stage 3 (its data on disk: nothing to generate), SIGTERM reaches rank 1
    # alone after the stage's 2nd update: the ranks agree (a max over ranks) to checkpoint and stop
    # there. A rank checkpointing alone would wait in the checkpoint's gathers while the other ran
    # the next update, until parallel.timeout_s (set short, so a bug fails rather than hangs).
    run = _resume_copy(two_rank_run, tmp_path / "run", "ckpt_000012_s003_u00000")
    script = tmp_path / "stop_rank1.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    os.environ['MUGRPO_STOP_AT'] = 'update:2'\n"
                      "from mugrpo.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), "train",
           "--resume", str(run), "parallel.timeout_s=60"]
    stopped = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert stopped.returncode != 0 and "exitcode  : 130" in stopped.stderr, stopped.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt_*")) == [
        "ckpt_000012_s003_u00000", "ckpt_000014_s003_u00002"]
    _mugrpo(2, ["--resume", str(run)])
    assert [r["update"] for r in _records(run, "update")] == [13, 14, 15, 16]  # each once (the copy holds no earlier log)
    for name, value in _weights(two_rank_run).items():
        torch.testing.assert_close(_weights(run)[name], value, rtol=0, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow  # ~10 s; the dynamic-sampling agreement is kept
def test_two_ranks_take_the_same_adaptive_stage_decisions(tiny_model, tmp_path):
    # The guard reads the update's metrics after their all-reduce, so both ranks end each stage at the
    # same update (a rank that went on alone would block in the next collective until the timeout).
    # kl_max 1e-12 trips at every update from the second on; min 3 updates: stages of 3, 3 and 2 (budget).
    run = tmp_path / "run"
    _mugrpo(2, ["--run-dir", str(run), f"model.name={tiny_model}", *COMMON, "schedule.total_updates=8",
                "schedule.num_stages=1", "schedule.adaptive=kl", "schedule.adaptive_kl_max=1e-12",
                "schedule.adaptive_min_updates=3", "train.save_final_model=false"])
    stages = _records(run, "stage")
    assert [(s["stage/num_updates"], s["stage/end_reason"]) for s in stages] == [(3, "kl"), (3, "kl"), (2, "budget")]
    assert [r["update"] for r in _records(run, "update")] == list(range(1, 9))
    # Both ranks' shards counted: 64 prompt groups per stage (mu 8 x 8), 3 x 8 of them drawn.
    assert stages[0]["stage/passes_used"] == 24 / 64


@pytest.mark.distributed
@pytest.mark.slow  # ~20 s; the full-model two-rank run is kept
def test_two_process_lora_run_matches_one_process_and_exports_merged_weights(tiny_model, tmp_path):
    # FSDP2 shards each decoder layer with its frozen base weights and trainable adapters in one unit.
    # One process resumes the 2-rank run from its start on the same stage data: same updates.
    run = tmp_path / "two"
    _mugrpo(2, ["--run-dir", str(run), f"model.name={tiny_model}", *COMMON, "schedule.total_updates=8",
                "schedule.num_stages=2", "schedule.micro_batch_size=8", "lora.rank=4", "optim.lr=1e-2"])
    one = _resume_copy(run, tmp_path / "one", None)
    _mugrpo(1, ["--resume", str(one)])
    updates_two, updates_one = _records(run, "update"), _records(one, "update")
    assert [r["update"] for r in updates_two] == [r["update"] for r in updates_one] == list(range(1, 9))
    for a, b in zip(updates_two, updates_one):  # tolerances as in the full fine-tuning test above
        for key in ("loss/total", "optim/grad_norm", "loss/kl_behavior"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["update"], key)
    # Checkpoints hold the adapters alone; the export is the plain model with them merged in.
    ckpt = sorted((run / "checkpoints").glob("ckpt_*"))[-1]
    assert all(".lora_" in name for name in load_file(str(ckpt / "model.safetensors")))
    w2, w1, w0 = _weights(run), _weights(one), load_file(str(tiny_model / "model.safetensors"))
    assert w2.keys() == w1.keys() == w0.keys()
    for name in w0:
        if name.endswith("_proj.weight"):  # the targeted layers moved, identically in both runs
            assert not torch.equal(w2[name], w0[name]), name
            torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-5)
        else:
            assert torch.equal(w2[name], w0[name]), name
    adapter = load_file(str(run / "final_model" / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 28 and all(k.startswith("base_model.model.model.layers.") for k in adapter)


@pytest.mark.slow  # ~23 s
@pytest.mark.distributed
def test_two_ranks_take_the_same_dynamic_sampling_rounds(tiny_model, tmp_path):
    # Dynamic sampling's round decisions use the largest shortfall over ranks and the summed counts,
    # so both ranks draw the same rounds (a rank that stopped alone would block in the next
    # collective), and each keeps its share of the informative groups: 4 updates x 8 prompts = 32
    # per stage, 16 per rank, every kept group with reward variance.
    run = tmp_path / "run"
    _mugrpo(2, ["--run-dir", str(run), f"model.name={tiny_model}", *COMMON, "task.reward_fn=sparse_rewards:has_one",
                "schedule.total_updates=8", "schedule.num_stages=2", "rollout.dynamic_sampling=true",
                "train.save_final_model=false"])
    stages = _records(run, "stage")
    assert len(stages) == 2 and [r["update"] for r in _records(run, "update")] == list(range(1, 9))
    for record in stages:
        assert record["stage/num_groups_needed"] == 32 and record["stage/num_sequences"] == 32 * 4
        for rank in range(2):
            shard = StageData.load(shard_path(run / "stages" / f"stage_{record['stage']:03d}", rank))
            assert shard.num_groups == 16
            assert bool((shard.rewards.view(-1, 4).std(dim=1) > 0).all()), (record["stage"], rank)
    assert stages[0]["stage/num_rounds"] >= 2  # about 1 group in 3 is informative: round 0's 64 are too few
