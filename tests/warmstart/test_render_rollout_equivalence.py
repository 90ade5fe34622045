"""A conversation rendered for SFT equals, id for id, the trajectory the rollout loop builds for it.

The engine is scripted to sample the demonstration's policy turns (the SFT ids of each turn); the
environment is real (the calculator tool, multi-attempt feedback), so every tool reply, every
environment turn and the prompt come from the rollout side's own code. The engine also checks,
at every turn, that the ids the loop asks it to continue are a prefix of the SFT ids. Then:
prompt + response ids are equal, the SFT turn indices are the trajectory's ``turns``, and the SFT
mask is ``turns >= 0`` (except a turn marked ``train: false``)."""

import copy

import pytest

from mugrpo.config import TaskConfig
from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.builtin import CalculatorEnvironment, MultiAttemptEnvironment
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, roll_out_items
from mugrpo.rollout.tasks import Item, extract_boxed
from mugrpo.warmstart.data import load_demonstrations
from mugrpo.warmstart.demos import calculator_rows
from mugrpo.warmstart.render import render_demonstration
from rollout.envs.test_render import TOOL_TEMPLATE


class DemoEngine:
    """Samples, for each prompt, the next policy turn of the example whose ids it extends."""

    def __init__(self, examples, eos):
        self.examples, self.eos, self.calls = examples, [eos], 0

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        self.calls += 1
        out = []
        for prompt, cap in zip(prompts, max_new_tokens):
            matches = [e for e in self.examples if e.input_ids[:len(prompt)] == prompt]
            assert len(matches) == 1, "the loop's ids so far are not a prefix of exactly one SFT example"
            ex = matches[0]
            start = len(prompt) - len(ex.prompt_ids)
            turn = ex.turns[start]
            assert turn >= 0, "the loop asks for a policy turn where the SFT example has an environment token"
            end = start
            while end < len(ex.turns) and ex.turns[end] == turn:
                end += 1
            ids = ex.response_ids[start:end]
            assert len(ids) <= cap
            out.append([Completion(ids, [-0.5] * len(ids), "stop")] * sampling.n)
        return out


def roll_out(tok, demos, factory, task_cfg=TaskConfig()):
    examples = [render_demonstration(tok, d) for d in demos]
    engine = DemoEngine(examples, tok.eos_token_id)
    items = [Item(f"q{d.index}", "", {}, d.prompt) for d in demos]
    limits = LoopLimits(max_turns=4, max_response_tokens=4000)
    ctx = LoopContext(engine, tok, limits, task_cfg)
    _, prompts, trajs = roll_out_items(ctx, factory, items, SamplingConfig(n=1, max_new_tokens=2000, seed=1),
                                       reset_seed=0)
    return examples, prompts, trajs, engine


@pytest.fixture(scope="module")
def smollm2():
    from mugrpo.models.loading import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("smollm2-135m-instruct"))


def tokenizers(smollm2):
    qwen_like = copy.deepcopy(smollm2)
    qwen_like.chat_template = TOOL_TEMPLATE  # renders the tools and the tool replies itself
    return {"tiny": build_char_tokenizer(), "smollm2": smollm2, "qwen_like": qwen_like}


@pytest.mark.parametrize("name", ["tiny", "smollm2", "qwen_like"])
def test_calculator_traces_render_as_the_rollout_loop_builds_them(smollm2, name):
    tok = tokenizers(smollm2)[name]
    # Two 2-call traces and one 1-call trace, written by the demo writer, through a JSON-schema tools
    # column (the rollout side describes the callable: the prompts must still agree).
    demos = load_demonstrations(calculator_rows(2, seed=3, num_calls=2) + calculator_rows(1, seed=4, num_calls=1))
    examples, prompts, trajs, engine = roll_out(tok, demos, CalculatorEnvironment)
    assert engine.calls == 3  # the longest trajectory has 3 policy turns: call, call, answer
    for ex, prompt, t in zip(examples, prompts, trajs):
        assert t.end_reason == "done" and t.metadata["tool_errors"] == 0
        assert ex.prompt_ids == prompt
        assert ex.input_ids == prompt + t.response_ids
        assert ex.turns == t.turns
        assert ex.response_mask == [int(k >= 0) for k in t.turns]
        assert ex.loss_mask == [0] * len(prompt) + [int(k >= 0) for k in t.turns]
    assert [max(t.turns) for t in trajs] == [2, 2, 1]
    # The tool replies the rollout got are the ones the demonstrations hold (the real calculator).
    assert all(extract_boxed(t.final_text) == row["answer"] for t, row in
               zip(trajs, calculator_rows(2, seed=3) + calculator_rows(1, seed=4, num_calls=1)))


def test_smollm2_eos_after_a_tool_call_is_an_environment_token(smollm2):
    (demo,) = load_demonstrations(calculator_rows(1, seed=0, num_calls=1))
    ex = render_demonstration(smollm2, demo)
    eos = smollm2.eos_token_id
    positions = [i for i, t in enumerate(ex.response_ids) if t == eos]
    # Three EOS: the one closing the tool-call turn (the stop string ended that turn; the environment
    # turn starts with it), the one closing the tool-response user turn, and the one the policy
    # samples to end its final answer (the last token).
    assert len(positions) == 3 and positions[-1] == len(ex.response_ids) - 1
    assert [ex.turns[i] for i in positions] == [-1, -1, 1]
    assert [ex.response_mask[i] for i in positions] == [0, 0, 1]
    assert ex.turns[positions[0] - 1] == 0 and smollm2.decode(ex.response_ids[:positions[0]]).endswith("</tool_call>")


def attempts_row():
    return {"messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "\\boxed{5}", "train": False},
        {"role": "user", "content": "Incorrect, try again."},
        {"role": "assistant", "content": "\\boxed{4}"}]}


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_feedback_after_a_final_answer_and_an_untrained_turn(smollm2, name):
    tok = tokenizers(smollm2)[name]
    demos = load_demonstrations([attempts_row()])

    def factory():
        return MultiAttemptEnvironment(max_attempts=3, score=lambda text, item: float(extract_boxed(text) == "4"))

    (ex,), (prompt,), (t,), _ = roll_out(tok, demos, factory)
    assert (t.end_reason, t.num_turns) == ("done", 2)
    assert ex.input_ids == prompt + t.response_ids and ex.turns == t.turns
    # The first attempt is a policy turn (turn 0) left out of the loss; the second one is trained.
    assert ex.response_mask == [int(k == 1) for k in t.turns]
    first = [i for i, k in enumerate(t.turns) if k == 0]
    assert t.response_ids[first[-1]] == tok.eos_token_id  # the attempt ended on EOS, sampled by the policy
