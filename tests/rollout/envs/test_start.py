"""Starting a stage's trajectories: G reset environments per item and each group's prompt ids."""

import pytest

from mugrpo.config import TaskConfig
from mugrpo.errors import TaskError
from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.envs import Environment, StepResult
from mugrpo.rollout.envs.builtin import CalculatorEnvironment
from mugrpo.rollout.envs.start import reset_seed, start_trajectories
from mugrpo.rollout.tasks import Item

CFG = TaskConfig(instruction="", few_shot=[], system_prompt="")
ITEMS = [Item("1+1?", "2"), Item("2+3?", "5")]


class Recorder(Environment):
    closed: list = []

    def __init__(self, prompt=None, fail=False):
        self.prompt, self.fail = prompt, fail

    def reset(self, item, seed):
        if self.fail:
            raise RuntimeError("no board")
        self.item, self.seed = item, seed
        return self.prompt(item, seed) if callable(self.prompt) else self.prompt

    def step(self, action):
        return StepResult([], done=True)

    def close(self):
        Recorder.closed.append(self)


def test_groups_share_the_prompt_and_each_member_has_its_seed():
    tok = build_char_tokenizer()
    started = start_trajectories(Recorder, ITEMS, 3, seed=7, tokenizer=tok, task_cfg=CFG)
    prompts, envs = started.prompts, started.envs
    assert [tok.decode(p) for p in prompts] == ["u:1+1?\na:", "u:2+3?\na:"]  # the task's usual prompt
    assert [e.item.question for e in envs] == ["1+1?"] * 3 + ["2+3?"] * 3  # group-major
    assert [e.seed for e in envs] == [reset_seed(7, i, g) for i in range(2) for g in range(3)]
    assert len({e.seed for e in envs}) == 6


def test_the_environment_prompt_and_tools_are_rendered():
    tok = build_char_tokenizer()
    prompts = start_trajectories(lambda: Recorder(lambda item, seed: [{"role": "user", "content": "go"}]),
                                 ITEMS[:1], 2, 0, tok, CFG).prompts
    assert tok.decode(prompts[0]) == "u:go\na:"
    prompts = start_trajectories(CalculatorEnvironment, ITEMS[:1], 2, 0, tok, CFG).prompts
    text = tok.decode(prompts[0])
    assert text.startswith("s:# Tools") and '"name": "calculate"' in text and text.endswith("u:1+1?\na:")


@pytest.mark.parametrize("make, says", [
    (lambda: Recorder(fail=True), "Recorder.reset raised on item '1\\+1\\?': RuntimeError: no board"),
    (lambda: Recorder("not messages"), "reset returned 'not messages'"),
    (lambda: Recorder([{"role": "user"}]), "reset returned"),
    (lambda: Recorder(lambda item, seed: [{"role": "user", "content": str(seed)}]), "different prompts"),
])
def test_bad_resets_stop_with_a_message_and_close_what_was_made(make, says):
    Recorder.closed = []
    with pytest.raises(TaskError, match=says):
        start_trajectories(make, ITEMS, 2, 0, build_char_tokenizer(), CFG)
    assert len(Recorder.closed) == 2  # the first group was made, then closed
