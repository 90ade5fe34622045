"""A stage's round sampled through an environment (mugrpo.stages.samplers.TrajectorySampler): what
scoring needs (texts of the final policy turns, environment rewards, turns); the prompt-length rule."""
import pytest

from mugrpo.config import TaskConfig
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopLimits
from mugrpo.rollout.tasks import build_task
from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.stages.samplers import RolloutParts, TrajectorySampler


class Echo:
    """Every prompt's G completions: the text 'ok' as ids, then EOS; records the prompts."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        self.prompts.append(prompts)
        ids = self.tok("ok")["input_ids"] + [self.tok.eos_token_id]
        return [[Completion(ids, [-1.0] * len(ids), "stop") for _ in range(sampling.n)] for _ in prompts]


class Bonus(Environment):
    """Done at once with an environment reward of 0.25."""

    def step(self, action):
        return StepResult([], reward=0.25, done=True)


def _task(**kw):
    cfg = TaskConfig(instruction="", few_shot=[], system_prompt="", eval_size=0,
                     reward_fn="toy_rewards:frac_ones", **kw)
    rows = [{"question": "1", "answer": "1"}, {"question": "a much longer question", "answer": "2"}]
    return cfg, build_task(cfg, rows=rows)


def sample(engine, tok, task, cfg):
    sampler = TrajectorySampler(RolloutParts(engine, task, tok, Bonus), cfg, LoopLimits(max_turns=2, max_response_tokens=8))
    indices, prompts = sampler.prompts([0, 1])
    return sampler.sample(indices, prompts, SamplingConfig(n=2, max_new_tokens=8), lambda n: None, reset_seed=0)


def test_the_stage_carries_texts_env_rewards_turns_and_counts():
    tok = build_char_tokenizer()
    cfg, task = _task()
    stage = sample(Echo(tok), tok, task, cfg)
    assert stage.env_rewards.tolist() == [0.25] * 4
    assert stage.texts == ["ok"] * 4 and stage.turns == [[0, 0, 0]] * 4 and stage.finished.all()
    assert stage.env_counts["env/num_done"] == 4 and stage.env_counts["env/reward_sum"] == 1.0
    assert stage.indices == [0, 1]


def test_the_prompt_length_rule_applies_to_environment_prompts():
    tok = build_char_tokenizer()
    # "u:1\na:" is 6 tokens; the second item's prompt is longer than 10.
    cfg, task = _task(max_prompt_tokens=10, prompt_too_long="skip")
    engine = Echo(tok)
    stage = sample(engine, tok, task, cfg)
    assert stage.indices == [0] and len(stage.responses) == 2 and engine.prompts[0] == [tok("u:1\na:")["input_ids"]]
    cfg, task = _task(max_prompt_tokens=10, prompt_too_long="truncate")
    with pytest.raises(ValueError, match="truncate is not applied"):
        sample(Echo(tok), tok, task, cfg)
