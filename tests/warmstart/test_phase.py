"""The warm start as a training phase (mugrpo.warmstart.phase, mugrpo.warmstart.loss): the loss by hand,
the data order, micro-batching, that it learns the demonstrations, kill-and-resume, the warm start of an
RL run (its stage 0 sampled by the warm-started model), and bad input exiting 2."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import TESTS, TINY_OVERRIDES
from safetensors.torch import load_file

from mugrpo.config import ConfigError, dump_yaml, load_config
from mugrpo.observability.loggers import read_metrics
from mugrpo.run_dir import RunDir
from mugrpo.warmstart.loss import num_steps, sft_loss
from mugrpo.kit.order import step_examples
from mugrpo.warmstart.render import Example

ANSWER = "11111"
DEMO_ROWS = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": ANSWER}]}
             for i in range(6)]
SFT_KEYS = ["train.autocast=none", "train.progress=false", "train.deterministic=true", "train.threads=1",
            "warmstart.batch_size=2", "warmstart.lr=1e-2"]


# ---------------------------------------------------------------------------------------------
# The math and the data order, by hand.


def test_sft_loss_by_hand():
    # Two trained tokens with probabilities 1/2 and 1/4, one masked token (any value, even -inf's neighbour):
    # NLL = ln 2 + ln 4 = 3 ln 2; over the 2 trained tokens: 1.5 ln 2 = 1.0397.
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25), -30.0]])
    mask = torch.tensor([[True, True, False]])
    loss, nll = sft_loss(logprobs, mask, 2.0)
    assert loss.item() == pytest.approx(1.5 * math.log(2))
    assert nll.item() == pytest.approx(3 * math.log(2))
    # The normaliser is the step's: with 4 trained tokens in the step (2 in another micro-batch) it halves.
    assert sft_loss(logprobs, mask, 4.0)[0].item() == pytest.approx(0.75 * math.log(2))


def test_masked_tokens_get_no_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    sft_loss(logprobs, torch.tensor([[True, False, True]]), 2.0)[0].backward()
    assert logprobs.grad.tolist() == [[-0.5, 0.0, -0.5]]  # d(-(a + c) / 2) = -1/2 on a and c, 0 on b


def test_data_order_is_seeded_epochs_laid_end_to_end():
    # 10 examples, 4 a step: steps 0..4 are 20 positions = 2 epochs, step 2 straddles them (8..11).
    order = [i for step in range(5) for i in step_examples(10, 4, step, seed=3)]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10))
    assert step_examples(10, 4, 2, seed=3) == order[8:12]  # a pure function of (seed, step)
    assert order[:10] != list(range(10)) and order[:10] != order[10:]  # shuffled, each epoch its own way
    assert [i for s in range(5) for i in step_examples(10, 4, s, seed=4)] != order
    assert step_examples(3, 5, 0, seed=0)[:3] != [] and len(step_examples(3, 5, 0, seed=0)) == 5  # batch > data


def test_number_of_steps():
    assert num_steps(10, 4, 2, None) == 6  # 2 epochs x ceil(10 / 4)
    assert num_steps(10, 4, 2, 7) == 7


def test_untrained_turn_leaves_the_mask():
    from mugrpo.kit.batching import collate
    from mugrpo.warmstart.phase import ExampleSet

    # turn 0 trained (2 tokens), an environment token, turn 1 marked train: false (2 tokens)
    ex = Example([5, 6], [7, 8, 9, 10, 11], [0, 0, -1, 1, 1], [1, 1, 0, 0, 0])
    data = ExampleSet.of([ex])
    assert data.turns == [[0, 0, -1, -1, -1]] and data.num_policy_tokens(0) == 2
    assert collate(data, [0], pad_id=0).response_mask.tolist() == [[True, True, False, False, False]]


def test_config_section_is_checked():
    for key, value in (("warmstart.batch_size", 0), ("warmstart.lr", 0), ("warmstart.epochs", 0),
                       ("warmstart.max_length", 1), ("warmstart.steps", 0)):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(overrides=[f"{key}={value}"])


# ---------------------------------------------------------------------------------------------
# The phase on the tiny model.


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("demos") / "demos.jsonl", DEMO_ROWS)


def _phase(tiny_model_dir, demos, tmp_path, *overrides):
    from mugrpo.kit import distributed as dist
    from mugrpo.warmstart.phase import WarmStart, load

    cfg = load_config(overrides=[f"model.name={tiny_model_dir}", f"warmstart.data={demos}", *SFT_KEYS, *overrides])
    return WarmStart.build(cfg, dist.init(), RunDir(tmp_path), load(cfg))


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir, demos, tmp_path):
    from mugrpo.kit.batching import micro_batches

    phase = _phase(tiny_model_dir, demos, tmp_path, "warmstart.batch_size=4")
    seqs = [0, 3, 4, 5]
    policy = phase.model.policy
    loss_one, tokens = phase.gradients(seqs)  # budget 1024: one micro-batch
    whole = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad(set_to_none=True)
    phase.cfg.schedule.micro_batch_tokens = 16  # a 16-token budget: each example alone (15 tokens)
    layout = dict(shared=False, budget=16, max_seqs=None, pad_id=0)
    assert len(micro_batches(phase.data, seqs, **layout)) == 4
    loss_split, _ = phase.gradients(seqs)
    assert tokens == 24  # 4 examples x ("11111" + EOS)
    assert loss_split == pytest.approx(loss_one)
    for a, b in zip(whole, (p.grad for p in policy.parameters())):
        # float32 sums in another order: agreement to float32 rounding, far below a wrong normaliser's factor 4
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _env(die_at=None):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("MUGRPO_DIE_AT", "MUGRPO_STOP_AT"):
        env.pop(key, None)
    if die_at:
        env["MUGRPO_DIE_AT"] = die_at
    return env


def _mugrpo(*args, die_at=None):
    return subprocess.run([sys.executable, "-m", "mugrpo", *map(str, args)], env=_env(die_at), capture_output=True,
                          text=True)


def _sft_cmd(run_dir, model_dir, demos):
    return ["sft", "--run-dir", run_dir, f"model.name={model_dir}", f"warmstart.data={demos}", *SFT_KEYS,
            "warmstart.epochs=4", "warmstart.checkpoint_every=3"]


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, tiny_model_dir, demos):
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    r = _mugrpo(*_sft_cmd(run_dir, tiny_model_dir, demos))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _nll(model_dir, prompt_ids, answer_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0, len(prompt_ids) - 1:-1].log_softmax(-1)
    return -logprobs.gather(1, torch.tensor(answer_ids)[:, None]).mean().item(), model


def test_warm_start_learns_the_demonstrated_answer(sft_reference, tiny_model_dir):
    from mugrpo.models.tiny import build_char_tokenizer
    from mugrpo.rollout.envs import render

    tok = build_char_tokenizer()
    prompt = render.prompt_ids(tok, [{"role": "user", "content": "q2"}], [])
    answer = tok(ANSWER, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    before, _ = _nll(tiny_model_dir, prompt, answer)
    after, model = _nll(str(sft_reference / "final_model"), prompt, answer)
    # the random tiny model: about ln(vocab) = ln(103) = 4.6 nats a token; 12 steps at lr 1e-2 bring it far down
    assert before > 3.0 and after < 0.5 * before, (before, after)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out[0, len(prompt):].tolist() == answer  # greedy decoding reproduces the demonstrated reply
    records = read_metrics(sft_reference / "metrics.jsonl")
    steps = [r for r in records if r["kind"] == "sft"]
    assert [r["update"] for r in steps] == list(range(1, 13))  # 4 epochs x ceil(6 / 2)
    assert all(r["sft/num_tokens"] == 12 for r in steps)  # 2 demonstrations x 6 trained tokens
    assert steps[-1]["sft/loss"] < steps[0]["sft/loss"] and steps[0]["optim/lr"] == 1e-2
    assert [r for r in records if r["kind"] == "sft_data"][0]["num_loss_tokens"] == 36


def _same_weights(a, b):
    ref, got = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ref.keys() == got.keys()
    return all(ref[k].equal(got[k]) for k in ref)


# after a checkpoint (step 3); before any
@pytest.mark.parametrize("die_at", [pytest.param("sft_step:5", marks=pytest.mark.slow), "sft_step:2"])
def test_killed_warm_start_resumes_bitwise(tmp_path, tiny_model_dir, demos, sft_reference, die_at):
    run_dir = tmp_path / "run"
    killed = _mugrpo(*_sft_cmd(run_dir, tiny_model_dir, demos), die_at=die_at)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (run_dir / "final_model").exists()
    resumed = _mugrpo("sft", "--resume", run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _same_weights(sft_reference / "final_model", run_dir / "final_model")
    ref = [r["sft/loss"] for r in read_metrics(sft_reference / "metrics.jsonl") if r["kind"] == "sft"]
    got = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "sft"]
    assert [r["update"] for r in got] == list(range(1, 13)) and [r["sft/loss"] for r in got] == ref
    assert len([r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "sft_data"]) == 1


# ---------------------------------------------------------------------------------------------
# The warm start of an RL run.


def _train_cmd(run_dir, model_dir, demos):
    return ["train", "--run-dir", run_dir, f"model.name={model_dir}", f"warmstart.data={demos}", *TINY_OVERRIDES,
            *SFT_KEYS, "warmstart.epochs=4", "warmstart.checkpoint_every=3", "schedule.total_updates=2",
            "schedule.num_stages=1", "schedule.prompts_per_update=2", "rollout.group_size=2", "eval.num_items=0"]


@pytest.fixture(scope="module")
def train_reference(tmp_path_factory, tiny_model_dir, demos):
    run_dir = tmp_path_factory.mktemp("train") / "run"
    r = _mugrpo(*_train_cmd(run_dir, tiny_model_dir, demos))
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_rl_run_starts_from_the_warm_started_model(train_reference, sft_reference, tiny_model_dir):
    import yaml

    from mugrpo.stages.data import StageData
    from mugrpo.kit.batching import collate
    from mugrpo.kit.forward import response_logprobs

    warm = train_reference / "warmstart"
    # The sub-run is the warm start `mugrpo sft` does with the same settings: the same weights.
    assert _same_weights(sft_reference / "final_model", warm / "final_model")
    config = yaml.safe_load((train_reference / "config.yaml").read_text())
    assert config["model"]["name"] == tiny_model_dir and config["warmstart"]["data"]  # what was asked for
    # Stage 0's behaviour log-probs (the engine's, stored at sampling) are the warm-started model's, not the base's.
    data = StageData.load(train_reference / "stages" / "stage_000" / "rollouts_rank0.safetensors")
    mb = collate(data, list(range(len(data.responses))), pad_id=0)

    def logprobs(folder):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            return response_logprobs(model, mb, config["rollout"]["temperature"], False, False, False)[0]

    stored, mask = mb.behavior_logprobs, mb.response_mask
    assert torch.allclose(logprobs(str(warm / "final_model"))[mask], stored[mask], atol=1e-4)
    assert not torch.allclose(logprobs(tiny_model_dir)[mask], stored[mask], atol=1e-2)
    steps = [r for r in read_metrics(warm / "metrics.jsonl") if r["kind"] == "sft"]
    assert len(steps) == 12 and not any(r["kind"] == "sft" for r in read_metrics(train_reference / "metrics.jsonl"))


@pytest.mark.slow  # ~12 s; the sft run's kill is kept
def test_rl_run_killed_in_its_warm_start_resumes_bitwise(tmp_path, tiny_model_dir, demos, train_reference):
    run_dir = tmp_path / "run"
    killed = _mugrpo(*_train_cmd(run_dir, tiny_model_dir, demos), die_at="sft_step:4")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (run_dir / "config.yaml").is_file() and not (run_dir / "warmstart" / "final_model").exists()
    resumed = _mugrpo("train", "--resume", run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _same_weights(train_reference / "warmstart" / "final_model", run_dir / "warmstart" / "final_model")
    assert _same_weights(train_reference / "final_model", run_dir / "final_model")


def test_warm_start_of_another_base_model_is_refused(tmp_path, tiny_model_dir, demos):
    from mugrpo.pipeline import warm_start as warm_start_model

    base = load_config(overrides=[f"model.name={tiny_model_dir}", f"warmstart.data={demos}"])
    sub = RunDir(tmp_path / "run").warmstart
    sub.mkdir(parents=True)
    (sub / "config.yaml").write_text(dump_yaml(base))
    other = load_config(overrides=["model.name=/elsewhere/model", f"warmstart.data={demos}"])
    with pytest.raises(ConfigError, match=r"model\.name='/elsewhere/model'.*trained from model\.name="):
        warm_start_model(other, RunDir(tmp_path / "run"))


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one message, nothing left behind.


@pytest.mark.parametrize("content,message", [
    ("", "the dataset is empty"),
    (json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n", "row 0"),
    pytest.param(json.dumps({"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]})
                 + "\n", "row 0", marks=pytest.mark.slow),
    ("{not json\n", "line 1"),
])
@pytest.mark.parametrize("verb", ["sft", pytest.param("train", marks=pytest.mark.slow)])
def test_bad_demonstrations_exit_2(tmp_path, tiny_model_dir, content, message, verb):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    run_dir = tmp_path / "run"
    args = [verb, "--run-dir", run_dir, f"model.name={tiny_model_dir}", f"warmstart.data={bad}", *TINY_OVERRIDES]
    r = _mugrpo(*args)
    assert r.returncode == 2, r.stderr[-3000:]
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_sft_without_data_exits_2(tmp_path, tiny_model_dir):
    r = _mugrpo("sft", "--run-dir", tmp_path / "run", f"model.name={tiny_model_dir}")
    assert r.returncode == 2 and "warmstart.data" in r.stderr and "Traceback" not in r.stderr


def test_python_api_runs_a_warm_start(tmp_path, tiny_model_dir, demos):
    import mugrpo
    from mugrpo.config import parse_override

    keys = dict(parse_override(k) for k in SFT_KEYS)
    result = mugrpo.sft({"model.name": tiny_model_dir, **keys, "warmstart.steps": 2}, data=demos,
                        run_dir=tmp_path / "run")
    assert result.final_model == tmp_path / "run" / "final_model" and (result.final_model / "config.json").is_file()
    assert [r["update"] for r in result.metrics("sft")] == [1, 2]


def test_lora_warm_start_exports_merged_weights_and_the_adapter(tmp_path, tiny_model_dir, demos):
    import mugrpo
    from mugrpo.config import parse_override

    keys = dict(parse_override(k) for k in SFT_KEYS)
    result = mugrpo.sft({"model.name": tiny_model_dir, **keys, "warmstart.steps": 3, "lora.rank": 4,
                         "lora.target_modules": "all-linear"}, data=demos, run_dir=tmp_path / "run")
    assert (result.final_model / "adapter").is_dir()
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    merged = load_file(str(result.final_model / "model.safetensors"))
    assert base.keys() == merged.keys()  # a plain HF model under the base model's names
    assert any(not base[k].equal(merged[k]) for k in base)  # the trained adapters are merged in
