"""Multi-turn on the HF engine and the tiny model: stop strings, token exactness, and the trainer's
recompute of the behaviour log-probs (ratio 1 at a stage's first update, fp32)."""
import pytest
import torch

from mugrpo.config import RolloutConfig
from mugrpo.models.loading import load_policy, load_tokenizer
from mugrpo.rollout.engines.base import SamplingConfig
from mugrpo.rollout.engines.hf import HFEngine, StopStrings
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, run_trajectories
from mugrpo.kit.batching import micro_batches
from mugrpo.stages.data import StageData
from mugrpo.kit.batching import collate
from mugrpo.kit.forward import response_logprobs

# The random tiny model samples characters almost uniformly (~1 % each): five one-character stop
# strings end most 24-token turns early.
STOPS = ("=", "p", "&", "g", "3")


def _engine(model_dir, tok):
    return HFEngine(model_dir, tok, RolloutConfig(batch_size=64, dtype="float32"))


def _prompts(tok):
    return [tok("u:Calculate 5 - 3.\na:")["input_ids"], tok("u:Hi\na:")["input_ids"]]


def test_stop_criterion_stops_at_the_token_completing_a_multi_token_stop_string(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    prompt = tok("a:")["input_ids"]
    new = tok("x</c>yy")["input_ids"]  # one token per character
    crit = StopStrings(tok, ("</c>", "zz"), width=len(prompt), batch=1)
    stopped_at = None
    for t in range(1, len(new) + 1):
        if bool(crit(torch.tensor([prompt + new[:t]]), None)[0]) and stopped_at is None:
            stopped_at = t
    assert stopped_at == 5 and crit.ends == [5]  # "x</c>": the 5th new token ">" completes "</c>"


def test_stop_strings_cut_each_row_where_plain_generation_first_completes_one(tiny_model_dir):
    # Same seed with and without stop strings: every row draws the same tokens (finished rows are
    # padded, the random stream is per step), so each stopped row must be the plain row cut right
    # after the first token whose text completes a stop string, with the same log-probs.
    tok = load_tokenizer(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)
    plain = engine.generate(_prompts(tok), SamplingConfig(n=6, max_new_tokens=24, seed=1))
    stopped = engine.generate(_prompts(tok), SamplingConfig(n=6, max_new_tokens=24, seed=1, stop=STOPS))
    num_cut = 0
    for p_group, s_group in zip(plain, stopped):
        for p, s in zip(p_group, s_group):
            text = [tok.decode(p.token_ids[:t], skip_special_tokens=True) for t in range(len(p.token_ids) + 1)]
            first = next((t for t in range(1, len(text)) if any(x in text[t] for x in STOPS)), None)
            end = len(p.token_ids) if first is None else first
            assert s.token_ids == p.token_ids[:end] and s.behavior_logprobs == p.behavior_logprobs[:end]
            assert s.finish_reason == ("stop" if first is not None else p.finish_reason)
            num_cut += first is not None and first < len(p.token_ids)
    assert num_cut >= 6  # the stop strings did cut (most of the 12 rows)


def test_per_prompt_limits_cut_rows_at_their_own_length(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)
    full = engine.generate(_prompts(tok), SamplingConfig(n=1, max_new_tokens=12, seed=4))
    capped = engine.generate(_prompts(tok), SamplingConfig(n=1, max_new_tokens=12, seed=4), max_new_tokens=[5, 12])
    assert capped[1][0].token_ids == full[1][0].token_ids
    assert capped[0][0].token_ids == full[0][0].token_ids[:5]
    assert capped[0][0].finish_reason == ("length" if len(full[0][0].token_ids) > 5 else full[0][0].finish_reason)


class Feedback(Environment):
    """'no' twice, then done (reward = turns taken); stop strings end turns early."""

    stop = STOPS
    max_turns = 3

    def __init__(self):
        self.n = 0

    def step(self, action):
        self.n += 1
        if self.n == 3:
            return StepResult([], reward=float(self.n), done=True)
        return StepResult([{"role": "user", "content": "no" * self.n}])


class Recording:
    """Wraps an engine; keeps every completion it returned, per call."""

    def __init__(self, engine):
        self.engine, self.turns = engine, []

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        out = self.engine.generate(prompts, sampling, progress, max_new_tokens)
        self.turns.append([c for group in out for c in group])
        return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_multi_turn_trajectories_are_token_exact_and_recompute_to_ratio_one(tiny_model_dir, temperature):
    tok, policy = load_tokenizer(tiny_model_dir), load_policy(tiny_model_dir)
    engine = Recording(_engine(tiny_model_dir, tok))
    rendered = []

    def render(messages, ended_on_eos):
        ids = tok("".join(f"\n{m['role'][0]}:{m['content']}" for m in messages) + "\na:")["input_ids"]
        rendered.append(ids)
        return ids

    prompts, G = _prompts(tok), 3
    envs = [Feedback() for _ in range(len(prompts) * G)]
    ctx = LoopContext(engine, tok, LoopLimits(max_turns=3, max_response_tokens=60), render_env_turn=render,
                      eos=[tok.eos_token_id])
    trajs = run_trajectories(ctx, prompts, envs, SamplingConfig(temperature=temperature, max_new_tokens=12, seed=3))
    assert any(t.num_turns == 3 for t in trajs)  # some trajectories really are multi-turn
    # What the engine returned per trajectory, in the loop's order (turn 0: group-major; later
    # turns: the still-active trajectories in order).
    sampled = {i: [] for i in range(len(trajs))}
    active = list(range(len(trajs)))
    for call in engine.turns:
        for i, c in zip(active, call, strict=True):
            sampled[i].append(c)
        active = [i for i in active if trajs[i].num_turns > len(sampled[i])]
    # Each stored response is, segment by segment, policy turn k = exactly the k-th sampled ids and
    # log-probs, and each environment segment = one rendered turn, verbatim: never re-tokenized.
    env_segments = []
    for i, t in enumerate(trajs):
        segments = _segments(t.turns)
        policy_segs = [(a, b) for a, b, k in segments if k >= 0]
        assert [k for _, _, k in segments if k >= 0] == list(range(len(sampled[i])))
        for (a, b), c in zip(policy_segs, sampled[i], strict=True):
            assert t.response_ids[a:b] == c.token_ids and t.behavior_logprobs[a:b] == c.behavior_logprobs
        env_segments += [tuple(t.response_ids[a:b]) for a, b, k in segments if k < 0]
        assert all(t.behavior_logprobs[a:b] == [0.0] * (b - a) for a, b, k in segments if k < 0)
    assert sorted(env_segments) == sorted(map(tuple, rendered))
    _assert_ratio_one(policy, prompts, trajs, G, temperature)


def _assert_ratio_one(policy, prompts, trajs, G, temperature, tol=1e-5):
    n = len(trajs)
    data = StageData(prompts, [t.response_ids for t in trajs], [t.behavior_logprobs for t in trajs], torch.zeros(n),
                     torch.ones(n), torch.ones(n, dtype=torch.bool), list(range(len(prompts))), G,
                     turns=[t.turns for t in trajs])
    num_policy = sum(data.num_policy_tokens(s) for s in range(n))
    assert num_policy == sum(sum(k >= 0 for k in t.turns) for t in trajs) < sum(len(t.turns) for t in trajs)
    layouts = [collate(data, list(range(n)), pad_id=0),
               *micro_batches(data, list(range(n)), shared=True, budget=10**6, max_seqs=None, pad_id=0)]
    for mb in layouts:
        assert int(mb.response_mask.sum()) == num_policy  # environment tokens are not loss tokens
        with torch.no_grad():
            logprobs, _ = response_logprobs(policy, mb, temperature, False, False, False)
        # fp32, same weights: summation-order rounding only; tol is the single-turn parity tests'.
        assert (logprobs - mb.behavior_logprobs)[mb.response_mask].abs().max() < tol


def _segments(turns):
    """[(start, end, turn)] runs of equal turn index (consecutive environment turns cannot occur)."""
    out, start = [], 0
    for t in range(1, len(turns) + 1):
        if t == len(turns) or turns[t] != turns[start]:
            out.append((start, t, turns[start]))
            start = t
    return out


def test_a_stage_of_calculator_trajectories_from_the_factory(tiny_model_dir):
    # E1's calculator environment (a tool environment, stop "</tool_call>") through the whole path:
    # start (reset, prompt with the tool protocol), the loop on the HF engine, close. The random
    # model never writes a tool call, so every trajectory ends after turn 0: done (a final answer)
    # or length; what is checked is the plumbing: prompts, groups, ids, the stop string passed on.
    from mugrpo.config import TaskConfig
    from mugrpo.rollout.envs.builtin import CalculatorEnvironment
    from mugrpo.rollout.multiturn import loop_metrics, roll_out_items
    from mugrpo.rollout.tasks import Item

    tok = load_tokenizer(tiny_model_dir)
    engine = Recording(_engine(tiny_model_dir, tok))
    engine.eos = engine.engine.eos
    items = [Item("1+1?", "2"), Item("2+3?", "5")]
    ctx = LoopContext(engine, tok, LoopLimits(max_turns=2, max_response_tokens=8),
                      TaskConfig(instruction="", few_shot=[], system_prompt=""))
    kept, prompts, trajs = roll_out_items(ctx, CalculatorEnvironment, items, SamplingConfig(n=2, max_new_tokens=8, seed=0),
                                          reset_seed=1)
    assert kept == [0, 1] and len(prompts) == 2 and len(trajs) == 4
    assert tok.decode(prompts[1]).endswith("u:2+3?\na:") and '"name": "calculate"' in tok.decode(prompts[0])
    assert all(t.end_reason in ("done", "length") and t.turns == [0] * len(t.response_ids) for t in trajs)
    assert [t.response_ids for t in trajs] == [c.token_ids for c in engine.turns[0]]
    assert loop_metrics(trajs)["env/num_done"] + loop_metrics(trajs)["env/num_length"] == 4


class Jittery(Feedback):
    """Feedback whose steps take a random time: threads finish in a different order every run."""

    def step(self, action):
        import random
        import time

        time.sleep(random.random() * 0.05)
        return super().step(action)


def test_the_same_seed_gives_bitwise_the_same_trajectories_whatever_the_step_timing(tiny_model_dir):
    # What resume relies on: a stage killed mid-trajectory is generated again from scratch and must
    # come out identical (deterministic environments, seeded turns, results gathered by index).
    tok = load_tokenizer(tiny_model_dir)
    engine = _engine(tiny_model_dir, tok)

    def once():
        envs = [Jittery() for _ in range(6)]
        ctx = LoopContext(engine, tok, LoopLimits(max_turns=3, max_response_tokens=60, max_workers=6),
                          render_env_turn=lambda m, eos: tok(f"\nu:{m[0]['content']}\na:")["input_ids"],
                          eos=[tok.eos_token_id])
        return run_trajectories(ctx, _prompts(tok), envs, SamplingConfig(max_new_tokens=12, seed=9))

    a, b = once(), once()
    assert any(t.num_turns > 1 for t in a)
    for x, y in zip(a, b, strict=True):
        assert (x.response_ids, x.behavior_logprobs, x.turns, x.end_reason, x.env_reward) == (
            y.response_ids, y.behavior_logprobs, y.turns, y.end_reason, y.env_reward)
