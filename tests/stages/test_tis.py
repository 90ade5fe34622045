"""loss.behavior_logprobs=trainer (mugrpo.stages.tis): the TIS weight and mismatch metrics by hand, the
trainer-side recompute against a plain per-sequence forward, persistence, bad input, end to end."""
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.stages import tis
from mugrpo.kit.batching import collate_shared, make_rows
from mugrpo.config import ConfigError, LossConfig, load_config
from mugrpo.stages.data import StageData, StageDataError
from mugrpo.kit.batching import collate
from mugrpo.kit.distributed import World
from mugrpo.kit.forward import response_logprobs
from mugrpo.observability.loggers import read_metrics
from mugrpo.models.loading import load_policy
from mugrpo.algo.losses import LossSettings
from mugrpo.pipeline import train
from mugrpo.training.trainer import step_settings


def test_tis_weights_by_hand():
    # d = trainer - engine = [0.5, 1.0, -2.0]; C = 2: w = [e^0.5 = 1.6487, min(e^1 = 2.718, 2) = 2, e^-2 = 0.1353].
    trainer, engine = torch.tensor([[-1.0, -0.5, -3.0]]), torch.tensor([[-1.5, -1.5, -1.0]])
    torch.testing.assert_close(tis.tis_weights(trainer, engine, 2.0), torch.tensor([[1.648721, 2.0, 0.135335]]))
    # Same weights: w = 1 exactly (the fp32 engine case).
    assert tis.tis_weights(trainer, trainer, 2.0).eq(1.0).all()


def test_mismatch_sums_by_hand():
    # |d| = 0.5 + 1 + 2 = 3.5; k3 = (e^0.5 - 1.5) + (e - 2) + (e^-2 + 1) = 0.148721 + 0.718282 + 1.135335
    # = 2.002338; capped: only d = 1 > ln 2; w sum = 1.648721 + 2 + 0.135335 = 3.784056; 3 tokens.
    sums = tis.mismatch_sums(torch.tensor([-1.0, -0.5, -3.0]), torch.tensor([-1.5, -1.5, -1.0]), 2.0)
    # The hand values are rounded to 6 decimals, hence the tolerance.
    torch.testing.assert_close(sums, torch.tensor([3.5, 2.002338, 1.0, 3.784056, 3.0], dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


def test_uncapped_unclipped_tis_loss_equals_the_engine_ratio_loss():
    # w * rho = (pi_old / pi_engine) * (pi_theta / pi_old) = pi_theta / pi_engine: where no clip bound
    # binds and no weight is capped, the TIS loss and its gradient are the default (engine) loss's.
    # They part only where a bound binds on one ratio and not the other, where w > C, or at the veto.
    from mugrpo.algo.losses import LossInputs, LossSettings, policy_loss

    gen = torch.Generator().manual_seed(0)
    engine = -torch.rand(3, 5, generator=gen) * 3
    trainer = engine + (torch.rand(3, 5, generator=gen) - 0.5) * 0.2  # |mismatch| < 0.1 < ln 2
    theta = trainer + (torch.rand(3, 5, generator=gen) - 0.5) * 0.2  # rho within [0.8, 1.2]: no bound binds
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, 5, dtype=torch.bool)
    settings = LossSettings.from_config(LossConfig(clip_eps_low=0.3, clip_eps_high=0.3), 1)
    x1, x2 = theta.clone().requires_grad_(True), theta.clone().requires_grad_(True)
    plain, _ = policy_loss(LossInputs(x1, engine, adv, mask, 15.0), settings)
    weighted, _ = policy_loss(LossInputs(x2, trainer, adv, mask, 15.0, is_weights=tis.tis_weights(trainer, engine, 2.0)), settings)
    plain.backward()
    weighted.backward()
    torch.testing.assert_close(weighted, plain)
    torch.testing.assert_close(x2.grad, x1.grad)


def _stage(trainer: bool = True) -> StageData:
    # 2 groups of G = 2; trainer log-probs = engine log-probs + 0.1 (d = 0.1 everywhere), sequence 1 has A = 0.
    behavior = [[-1.0, -2.0], [-0.5], [-3.0, -0.25, -1.0], [-2.0]]
    return StageData([[5, 6, 7], [8, 9]], [[3, 4], [5], [6, 7, 8], [9]], behavior, torch.tensor([1.0, 0, 0, 1]),
                     torch.tensor([1.0, 0.0, -1.0, 1.0]), torch.ones(4, dtype=torch.bool), [0, 1], 2,
                     trainer_logprobs=[[v + 0.1 for v in b] for b in behavior] if trainer else None)


def test_trainer_logprobs_are_persisted_subset_and_laid_out_like_the_engines(tmp_path):
    data = _stage()
    data.save(tmp_path / "s.safetensors")
    back = StageData.load(tmp_path / "s.safetensors")
    torch.testing.assert_close(torch.tensor(back.trainer_logprobs[2]), torch.tensor(data.trainer_logprobs[2]))
    assert back.subset([1]).trainer_logprobs == [back.trainer_logprobs[2], back.trainer_logprobs[3]]
    _stage(trainer=False).save(tmp_path / "e.safetensors")
    assert StageData.load(tmp_path / "e.safetensors").trainer_logprobs is None
    # Both layouts: trainer log-probs sit where the engine's do, 0.1 above them on real tokens.
    for mb in (collate(back, [0, 1, 2, 3], 0), collate_shared(back, make_rows(back, [0, 1, 2, 3], True, 64), 0)):
        m = mb.response_mask
        torch.testing.assert_close(mb.trainer_logprobs[m], mb.behavior_logprobs[m] + 0.1)
        old, w = tis.ratio_inputs(mb, LossSettings.from_config(LossConfig(behavior_logprobs="trainer", tis_cap=2.0), 1))
        assert old is mb.trainer_logprobs
        torch.testing.assert_close(w[m], torch.full_like(w[m], math.exp(0.1)))
        old, w = tis.ratio_inputs(mb, LossSettings.from_config(LossConfig(), 1))
        assert old is mb.behavior_logprobs and w is None


def test_stage_metrics_by_hand_and_missing_trainer_logprobs_named(tmp_path):
    cfg = load_config("mu-grpo", overrides=["loss.behavior_logprobs=trainer"])
    # The A = 0 sequence 1 is not recomputed: 2 + 3 + 1 = 6 tokens, each d = 0.1:
    # |d| = 0.1, k3 = e^0.1 - 1.1 = 0.0051709, w = e^0.1 = 1.1051709, none capped at C = 2.
    m = tis.stage_metrics(_stage(), step_settings(cfg), World(), tmp_path)
    assert m["stage/num_recomputed_tokens"] == 6 and m["stage/tis_capped_frac"] == 0.0
    assert m["stage/engine_trainer_log_ratio_abs_mean"] == pytest.approx(0.1, rel=1e-6)
    assert m["stage/engine_logprob_mismatch"] == m["stage/engine_trainer_log_ratio_abs_mean"]
    assert m["stage/engine_trainer_kl"] == pytest.approx(0.0051709, rel=1e-4)
    assert m["stage/tis_weight_mean"] == pytest.approx(1.1051709, rel=1e-6)
    with pytest.raises(StageDataError, match="rollouts_rank0.safetensors.*holds no trainer log-probs.*resume"):
        tis.stage_metrics(_stage(trainer=False), step_settings(cfg), World(), tmp_path)
    assert tis.stage_metrics(_stage(trainer=False), step_settings(load_config("mu-grpo")), World(), tmp_path) == {}


@pytest.mark.parametrize("override, accepted", [
    ("loss.tis_cap=0", "finite number > 0"), ("loss.tis_cap=-1", "finite number > 0"),
    ("loss.tis_cap=.inf", "finite number > 0"), ("loss.behavior_logprobs=vllm", "engine"),
])
def test_bad_tis_settings_are_refused_naming_the_key(override, accepted):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}.*{accepted}"):
        load_config("mu-grpo", overrides=[override])


@pytest.mark.parametrize("shared", [True, False])
def test_recompute_equals_a_plain_forward_of_each_sequence(tiny_model_dir, shared):
    # Groups of different lengths, packed longest-first into several micro-batches: each sequence's
    # recomputed log-probs must land on that sequence (fp32: rounding only).
    gen = torch.Generator().manual_seed(0)
    G, lens = 3, [4, 1, 7, 2, 5, 3, 6, 2, 2]
    prompts = [torch.randint(3, 50, (n,), generator=gen).tolist() for n in (3, 6, 2)]
    responses = [torch.randint(3, 50, (n,), generator=gen).tolist() for n in lens]
    data = StageData(prompts, responses, [[-1.0] * n for n in lens], torch.zeros(9),
                     torch.tensor([1.0, 0.0, -1.0] * 3), torch.ones(9, dtype=torch.bool), [0, 1, 2], G)
    cfg = load_config("mu-grpo", overrides=[f"train.shared_prefix={str(shared).lower()}",
                                            "schedule.micro_batch_tokens=24"])
    model = load_policy(tiny_model_dir)
    out = tis.recompute_trainer_logprobs(model, data, dataclasses.replace(step_settings(cfg), autocast=False),
                                     torch.device("cpu"))
    for s in range(9):
        if s % 3 == 1:  # A = 0: not recomputed, keeps the engine's log-probs
            assert out.trainer_logprobs[s] == data.behavior_logprobs[s]
            continue
        with torch.no_grad():
            ref, _ = response_logprobs(model, collate(data, [s], 0), 1.0, False, False, False)
        torch.testing.assert_close(torch.tensor(out.trainer_logprobs[s]), ref[0], rtol=1e-5, atol=1e-6)


def test_tiny_run_with_trainer_logprobs_learns_and_matches_an_fp32_engine(tmp_path, tiny_model_dir):
    # The HF engine in float32 and the float32 trainer compute the same log-probs up to rounding:
    # mismatch ~0, every weight ~1, the first update of each stage sees ratio 1.
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES,
                                            "schedule.total_updates=16", "optim.lr=1e-2",
                                            "loss.behavior_logprobs=trainer", "train.save_final_model=false"])
    train(cfg, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    stages = [r for r in records if r["kind"] == "stage"]
    assert len(stages) == 4
    assert stages[-1]["reward/mean"] > stages[0]["reward/mean"] + 0.1, [r["reward/mean"] for r in stages]
    for r in stages:
        assert r["stage/num_recomputed_tokens"] > 0
        assert r["stage/engine_trainer_log_ratio_abs_mean"] < 1e-5
        assert abs(r["stage/tis_weight_mean"] - 1) < 1e-5 and r["stage/tis_capped_frac"] == 0.0
        assert r["stage/engine_logprob_mismatch"] == r["stage/engine_trainer_log_ratio_abs_mean"]
    firsts = [r for r in records if r["kind"] == "update" and r["update_in_stage"] == 0]
    assert all(r["loss/log_ratio_abs_mean"] < 1e-6 for r in firsts)
    shard = load_file(str(tmp_path / "run" / "stages" / "stage_001" / "rollouts_rank0.safetensors"))
    torch.testing.assert_close(shard["trainer_logprobs"], shard["behavior_logprobs"], rtol=0, atol=1e-5)


@pytest.mark.slow  # ~20 s; resume is kept in tests/kit/test_resume.py
def test_killed_and_resumed_tis_run_is_bitwise_identical(tmp_path, tiny_model_dir):
    # Mid-stage 1 kill (stage 1's data, trainer log-probs included, already on disk): the resumed run
    # reads them back and ends with the uninterrupted run's parameters, bit for bit.
    def cmd(run_dir):
        return [sys.executable, "-m", "mugrpo", "train", "--run-dir", str(run_dir), f"model.name={tiny_model_dir}",
                *TINY_OVERRIDES, "schedule.total_updates=8", "schedule.num_stages=2", "optim.lr=1e-2",
                "train.deterministic=true", "train.threads=1", "checkpoint.every_updates=2",
                "loss.behavior_logprobs=trainer", "loss.tis_cap=1.5"]

    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MUGRPO_DIE_AT", None)
    ref = subprocess.run(cmd(tmp_path / "ref"), env=env, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = subprocess.run(cmd(tmp_path / "run"), env={**env, "MUGRPO_DIE_AT": "update:6"}, capture_output=True,
                            text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = subprocess.run([sys.executable, "-m", "mugrpo", "train", "--resume", str(tmp_path / "run")], env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = load_file(str(tmp_path / "ref" / "final_model" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "final_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    losses = [[r["loss/policy"] for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "update"]
              for d in (tmp_path / "ref", tmp_path / "run")]
    assert len(losses[0]) == 8 and losses[0] == losses[1]
    resumed_stage = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "stage"][-1]
    assert resumed_stage["stage/resumed"] == 1.0 and "stage/tis_weight_mean" in resumed_stage


@pytest.mark.slow  # ~33 s
@pytest.mark.distributed
def test_two_rank_recompute_under_fsdp2_matches_the_engine_and_one_process(tiny_model_dir, tmp_path):
    # 2 ranks with FSDP2: each recomputes its own shard; with at most 4 sequences per micro-batch and
    # the zero-advantage skip, the ranks hold different numbers of forwards (filler passes run). The
    # fp32 HF engine computed the same log-probs, so each shard's trainer log-probs equal its engine
    # log-probs up to rounding. Then ONE process resumes from the start on both shards (it
    # regenerates nothing) and must make the same 4 updates (tolerance as in test_distributed.py).
    from kit.test_distributed import COMMON, _mugrpo, _records, _resume_copy

    run = tmp_path / "two"
    _mugrpo(2, ["--run-dir", str(run), f"model.name={tiny_model_dir}", *COMMON, "schedule.total_updates=4",
                "schedule.num_stages=2", "schedule.micro_batch_size=4", "loss.behavior_logprobs=trainer"])
    for stage in ("stage_000", "stage_001"):
        for rank in (0, 1):
            shard = load_file(str(run / "stages" / stage / f"rollouts_rank{rank}.safetensors"))
            torch.testing.assert_close(shard["trainer_logprobs"], shard["behavior_logprobs"], rtol=0, atol=1e-5)
    stages = _records(run, "stage")
    assert all(r["stage/engine_trainer_log_ratio_abs_mean"] < 1e-5 for r in stages)
    one = _resume_copy(run, tmp_path / "one", None)
    _mugrpo(1, ["--resume", str(one)])
    for a, b in zip(_records(run, "update"), _records(one, "update"), strict=True):
        for key in ("loss/policy", "optim/grad_norm", "loss/ratio_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["update"], key)
    assert [r["stage/tis_weight_mean"] for r in _records(one, "stage")] == [r["stage/tis_weight_mean"]
                                                                             for r in stages]
