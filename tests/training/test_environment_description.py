"""``mugrpo train`` says what its environment is at start (name, tools, max turns, stop strings, the
turn budget), as ``mugrpo plan`` does, from the start-up check's environments: saying it makes no
environment and calls nothing more of its code, so a run's environment calls (which a hostile
environment may count) are the same. The start-up check's calls are bounded and guarded."""
import threading

import pytest
from conftest import TINY_OVERRIDES
from multiturn_envs import TryAgain

from mugrpo.config import load_config
from mugrpo.errors import ConfigError
from mugrpo.observability.loggers import read_metrics
from mugrpo.rollout.envs.build import build_env_factory, describe_env
from mugrpo.pipeline import train

RELEASE = threading.Event()


class Counted(TryAgain):
    """TryAgain's game, counting the environments made and the tools() calls."""

    made = 0
    tools_calls = 0

    def __init__(self):
        super().__init__()
        Counted.made += 1

    def tools(self):
        Counted.tools_calls += 1
        return []


def test_train_says_what_the_environment_is_and_makes_no_environment_for_it(tmp_path, tiny_model_dir, capsys):
    Counted.made = Counted.tools_calls = 0
    cfg = load_config("mu-grpo", overrides=[f"model.name={tiny_model_dir}", *TINY_OVERRIDES,
                                            f"task.env={__name__}:Counted", "rollout.max_new_tokens=16",
                                            "env.max_turns=3", "eval.num_items=0", "schedule.total_updates=2",
                                            "schedule.num_stages=2", "env.step_isolation=thread"])  # counted here
    train(cfg, tmp_path / "run")
    out = capsys.readouterr().out
    rows = {k.strip(): v.strip() for k, v in (line.split("  ", 1) for line in out.splitlines()
                                              if line.startswith(("environment", "turns the budget")))}
    assert rows["environment"] == f"{__name__}.Counted"
    assert rows["environment tools"] == "none" and rows["environment max turns"] == "3"
    assert rows["environment stop strings"] == "'1'"
    assert "policy turns at the cap within rollout.max_new_tokens=16" in rows["turns the budget allows"]
    # Made: the start-up check's 2, then one per trajectory; tools(): the check's once, then once per
    # group (each group's first environment) -- describing made and asked nothing more.
    stages = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "stage"]
    assert len(stages) == 2
    sequences = sum(s["stage/num_sequences"] for s in stages)
    assert Counted.made == 2 + sequences
    assert Counted.tools_calls == 1 + sequences // cfg.rollout.group_size


class BrokenTools(TryAgain):
    def tools(self):
        raise RuntimeError("tools broke")


class HungConstructor(TryAgain):
    def __init__(self):
        RELEASE.wait(30)
        super().__init__()


class BrokenConstructor(TryAgain):
    def __init__(self):
        raise RuntimeError("constructor broke")


def _task(env):
    cfg = load_config(overrides=[])
    cfg.task.env = env
    cfg.env.reset_timeout_s = 0.5
    cfg.env.step_isolation = "thread"  # the calls counted and timed in this process
    return cfg


def test_the_start_up_checks_calls_are_bounded_and_a_failure_names_the_key():
    cfg = _task(BrokenTools)  # the stage counts tools() failing; the description says it
    rows = dict(describe_env(build_env_factory(cfg.task, cfg.env).summary))
    assert rows["environment tools"] == "unknown: BrokenTools.tools() raised RuntimeError: tools broke"
    cfg = _task(BrokenConstructor)  # before: a raw RuntimeError traceback
    with pytest.raises(ConfigError, match=r"task.env_args: making the environment \(BrokenConstructor\) at start "
                                          r"failed: RuntimeError: constructor broke"):
        build_env_factory(cfg.task, cfg.env)
    cfg = _task(HungConstructor)  # before: a hang
    try:
        with pytest.raises(ConfigError, match=r"making the environment \(HungConstructor\) at start ran past "
                                              r"env.reset_timeout_s=0.5 s"):
            build_env_factory(cfg.task, cfg.env)
    finally:
        RELEASE.set()
