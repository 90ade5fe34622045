"""Every call into an environment's code while a stage starts and ends is bounded and guarded: the
factory call, reset, tools() and close. A failure to start skips that item's group (counted, as the
prompt-length rule skips prompts); a stage where every item fails stops naming the environment and
the first error; a close that raises or hangs is counted, never a crash or a hang."""
import threading
import time

import pytest

from mugrpo.config import TaskConfig
from mugrpo.errors import TaskError
from mugrpo.models.tiny import build_char_tokenizer
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.multiturn import LoopLimits
from mugrpo.rollout.tasks import build_task
from mugrpo.stages.samplers import RolloutParts, TrajectorySampler

LIMITS = LoopLimits(max_turns=2, max_response_tokens=8, step_timeout_s=1.0, reset_timeout_s=1.0)
RELEASE = threading.Event()  # set at the end of the module: lets the hung calls' threads finish


class Echo:
    """Every prompt's G completions: 'ok' then EOS."""

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        ids = self.tok("ok")["input_ids"] + [self.tok.eos_token_id]
        return [[Completion(ids, [-1.0] * len(ids), "stop") for _ in range(sampling.n)] for _ in prompts]


class Hostile(Environment):
    """Done at once; ``fail`` names the call that raises ("reset", "tools", "close") or hangs ("hang_*")."""

    made = 0

    def __init__(self, fail=None, fail_from=0):
        Hostile.made += 1
        if fail == "init" and Hostile.made > fail_from:
            raise RuntimeError("constructor broke")
        self.fail = fail

    def _maybe(self, where):
        if self.fail == where:
            raise RuntimeError(f"{where} broke")
        if self.fail == f"hang_{where}":
            RELEASE.wait(30)

    def reset(self, item, seed):
        self._maybe("reset")
        return None

    def tools(self):
        self._maybe("tools")
        return []

    def step(self, action):
        return StepResult([], reward=0.5, done=True)

    def close(self):
        self._maybe("close")


def _task(n_items=3):
    cfg = TaskConfig(instruction="", few_shot=[], system_prompt="", eval_size=0, reward_fn="toy_rewards:frac_ones")
    return cfg, build_task(cfg, rows=[{"question": str(i), "answer": "1"} for i in range(n_items)])


def sample(factory, n_items=3):
    tok = build_char_tokenizer()
    cfg, task = _task(n_items)
    sampler = TrajectorySampler(RolloutParts(Echo(tok), task, tok, factory), cfg, LIMITS)
    indices, prompts = sampler.prompts(list(range(n_items)))
    return sampler.sample(indices, prompts, SamplingConfig(n=2, max_new_tokens=8), lambda n: None, reset_seed=0)


def test_a_constructor_that_raises_on_the_third_trajectory_skips_that_item_counted():
    Hostile.made = 0
    batch = sample(lambda: Hostile("init", fail_from=2))  # trajectories 1 and 2 are made
    assert batch.indices == [0] and len(batch.responses) == 2
    assert batch.env_counts["env/num_items_skipped"] == 2.0 and batch.env_counts["env/num_done"] == 2.0
    assert "constructor broke" in batch.env_problems["start_error"]
    assert "Traceback" in batch.env_problems["start_error"]


@pytest.mark.parametrize("fail", ["reset", "tools", "hang_reset", "hang_tools"])
def test_every_item_failing_to_start_stops_naming_the_environment_and_the_first_error(fail):
    t0 = time.monotonic()
    with pytest.raises(TaskError, match=r"every item of this stage failed to start its environment \(.*Hostile"
                       r"|every item of this stage failed to start its environment \(.*lambda") as info:
        sample(lambda: Hostile(fail), n_items=2)
    assert time.monotonic() - t0 < 10  # two hung items, 1 s each (reset_timeout_s), not forever
    text = str(info.value)
    assert ("ran past env.reset_timeout_s=1 s" in text) if fail.startswith("hang") else (f"{fail} broke" in text
                                                                                        and "Traceback" in text)


@pytest.mark.parametrize("fail", ["close", "hang_close"])
def test_a_close_that_raises_or_hangs_is_counted_and_reported(fail):
    t0 = time.monotonic()
    batch = sample(lambda: Hostile(fail), n_items=2)
    assert time.monotonic() - t0 < 10  # the four closes run concurrently, each at most step_timeout_s
    assert batch.env_counts["env/num_done"] == 4.0 and batch.env_counts["env/num_close_errors"] == 4.0
    assert batch.env_counts["env/num_items_skipped"] == 0.0
    problem = batch.env_problems["close_error"]
    assert ("close broke" in problem and "Traceback" in problem) if fail == "close" else "ran past 1 s" in problem


def test_release_hung_threads():
    RELEASE.set()
