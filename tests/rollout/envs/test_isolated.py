"""``env.step_isolation=process``, the default (mugrpo.rollout.envs.isolated, wired by
mugrpo.rollout.envs.build): each environment lives in a worker process with its state; a process exit
or a spin in a step, a tool that exits or never returns, ends that trajectory, counted, and the run
goes on; under thread isolation an os._exit is caught too; an environment that does not pickle runs on
threads with a warning; a constructor that exits stops the start with exit 2 naming it. Real worker
processes, no stand-ins."""
import functools
import os
import subprocess
import sys

import pytest
from memory_peak import TESTS

from conftest import TINY_OVERRIDES
from hostile_envs import Counting, ExitsWhenMade
from mugrpo.config import ConfigError, load_config
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.build import build_env_factory, describe_env
from mugrpo.rollout.envs.isolated import ProcessEnvironment
from mugrpo.observability.loggers import read_metrics
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, first_problems, loop_counts, run_trajectories

EOS = 2


class OneToken:
    def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
        return [[Completion([5, EOS], [-0.5, -0.5], "stop") for _ in range(sampling.n)] for _ in prompts]


def roll_out(envs, step_timeout_s=20.0):
    limits = LoopLimits(max_turns=4, max_response_tokens=100, step_timeout_s=step_timeout_s)
    ctx = LoopContext(OneToken(), None, limits, render_env_turn=lambda m, e: [7], decode=str, eos=[EOS])
    return run_trajectories(ctx, [[1]], envs, SamplingConfig(max_new_tokens=8, seed=0))


def test_the_environment_keeps_its_state_in_its_worker():
    env = ProcessEnvironment(functools.partial(Counting))
    assert (env.env_name, env.max_turns, env.stop) == ("hostile_envs.Counting", 4, ("!",))
    assert [env.step("a").reward for _ in range(3)] == [1.0, 2.0, 3.0]  # the count lives in the worker
    assert env.metrics() == {"steps_seen": 3}
    env.close()
    assert not env._proc.is_alive()


def test_a_process_exit_in_a_step_ends_that_trajectory_counted_and_the_others_go_on():
    envs = [ProcessEnvironment(functools.partial(Counting, exit_at=2)), ProcessEnvironment(functools.partial(Counting))]
    dying, fine = roll_out(envs)
    # the dying one: step 1 (reward 1), then its worker exits in step 2; the other: three steps, 1 + 2 + 3
    assert (dying.end_reason, dying.env_reward, dying.num_turns) == ("env_error", 1.0, 2)
    assert (fine.end_reason, fine.env_reward, fine.num_turns) == ("done", 6.0, 3)
    assert "worker process died during step (exit code 5" in first_problems([dying])["env_error"]
    counts = loop_counts([dying, fine])
    assert (counts["env/num_env_error"], counts["env/num_done"]) == (1.0, 1.0)
    assert counts["env/steps_seen"] == 3.0  # a dead worker's metrics are {}, not a second failure
    assert "env/num_close_errors" not in counts


def test_a_step_that_holds_the_gil_is_killed_at_the_step_timeout():
    env = ProcessEnvironment(functools.partial(Counting, spin_at=1), timeout_s=1.0)
    (t,) = roll_out([env], step_timeout_s=1.0)
    assert t.end_reason == "env_timeout"
    env._proc.join(10)
    assert not env._proc.is_alive()  # killed, not left spinning


ENV_CFG = ["env.step_isolation=process", "task.reward_fn=none"]


def test_the_config_builds_process_environments_and_says_so():
    cfg = load_config(overrides=["task.env=hostile_envs:Counting", *ENV_CFG])
    factory = build_env_factory(cfg.task, cfg.env)
    env = factory()
    try:
        assert isinstance(env, ProcessEnvironment) and env.step("x").reward == 1.0
    finally:
        env.close()
    rows = dict(describe_env(factory.summary))
    assert rows["environment"] == "hostile_envs.Counting"
    assert rows["environment isolation"] == "steps in a worker process per environment (env.step_isolation=process)"


def test_the_default_isolation_is_named_in_the_start_up_line():
    cfg = load_config(overrides=["task.tools=['mugrpo.rollout.envs.builtin:calculate']"])
    rows = dict(describe_env(build_env_factory(cfg.task, cfg.env).summary))
    assert rows["environment isolation"] == ("tool calls in worker processes (env.tool_isolation=process); the tool "
                                             "environment, mugrpo's own, in the trainer's process")
    cfg = load_config(overrides=["task.env=hostile_envs:Counting", "task.reward_fn=none"])
    rows = dict(describe_env(build_env_factory(cfg.task, cfg.env).summary))
    assert rows["environment isolation"] == "steps in a worker process per environment (env.step_isolation=process)"
    cfg = load_config(overrides=["task.tools=['mugrpo.rollout.envs.builtin:calculate']", "env.tool_isolation=thread",
                                 "env.step_isolation=thread"])
    rows = dict(describe_env(build_env_factory(cfg.task, cfg.env).summary))
    assert rows["environment isolation"] == ("steps in threads of the trainer's process (env.step_isolation=thread); "
                                             "tool calls in threads (env.tool_isolation=thread)")


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_constructor_that_exits_is_named_at_the_start_up_check_without_a_traceback(capsys, isolation):
    cfg = load_config(overrides=["task.env=hostile_envs:ExitsWhenMade", "task.reward_fn=none",
                                 f"env.step_isolation={isolation}"])
    with pytest.raises(ConfigError, match=r"task.env_args: making the environment \(ExitsWhenMade\) at start ended its "
                                          r"process \(exit code 9") as caught:
        build_env_factory(cfg.task, cfg.env)
    assert "Traceback" not in str(caught.value)
    assert f"making two environments with ExitsWhenMade (env.step_isolation={isolation})" in capsys.readouterr().err


def test_under_thread_isolation_a_process_exit_in_a_step_ends_that_trajectory_naming_the_step():
    dying, fine = roll_out([Counting(exit_at=2), Counting()])  # in this process: steps on the loop's threads
    assert (dying.end_reason, dying.env_reward, dying.num_turns) == ("env_error", 1.0, 2)
    assert (fine.end_reason, fine.env_reward) == ("done", 6.0)
    assert "Counting.step" in dying.error and "called os._exit(5)" in dying.error
    assert os.getpid() and os._exit.__name__ == "_guarded_exit"  # this process is still here, guarded


def test_an_environment_that_does_not_pickle_runs_on_threads_with_a_warning(capsys):
    class Inline(Counting):  # defined in a function: a worker process cannot import it
        pass

    cfg = load_config(overrides=["task.reward_fn=none"])
    cfg.task.env = Inline
    rows = dict(describe_env(build_env_factory(cfg.task, cfg.env).summary))
    assert rows["environment isolation"] == "steps in threads of the trainer's process (env.step_isolation=thread)"
    err = capsys.readouterr().err
    assert "warning: env.step_isolation=process: the environment " in err and "<locals>.Inline does not pickle" in err
    assert "runs on threads of the trainer's process instead" in err


def test_step_isolation_is_validated():
    with pytest.raises(ConfigError, match=r"env\.step_isolation"):
        load_config(overrides=["env.step_isolation=fork"])




def _run(tmp_path, tiny_model_dir, *extra):
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "mugrpo", "train", "--run-dir", str(tmp_path / "run"),
                           f"model.name={tiny_model_dir}", *TINY_OVERRIDES, "schedule.total_updates=1",
                           "schedule.num_stages=1", "schedule.prompts_per_update=2", "rollout.group_size=2",
                           "eval.num_items=0", "train.threads=1", *extra], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("env,args,warning", [
    ("Counting", "{exit_at: 1}", "environment hostile_envs.Counting: its worker process died during step (exit code 5"),
    ("ForcedTool", "{tool: die}", "tool 'die' ended its process (exit code 3)"),
    ("ForcedTool", "{tool: backtrack}", "env timeout (hostile_envs.ForcedTool)"),
])
def test_with_no_isolation_keys_user_code_that_exits_or_hangs_ends_its_trajectory_and_the_run_goes_on(
        tmp_path, tiny_model_dir, env, args, warning):
    r = _run(tmp_path, tiny_model_dir, f"task.env=hostile_envs:{env}", f"task.env_args={args}", "task.reward_fn=none",
             "env.tool_timeout_s=1", "env.step_timeout_s=3", "task.max_prompt_tokens=1000")  # the tool protocol text
    assert r.returncode == 0, r.stderr[-3000:]
    assert "env.step_isolation=process" in r.stdout
    assert warning in r.stdout, r.stdout[-3000:]
    (stage,) = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if m["kind"] == "stage"]
    failed = stage.get("env/num_env_error", 0) + stage.get("env/num_env_timeout", 0)
    # 2 prompts x 2 trajectories: each that reached a step (its turn not cut at the token budget) failed there
    assert failed >= 1 and failed + stage.get("env/num_length", 0) == 4.0


@pytest.mark.parametrize("isolation", [None, pytest.param("thread", marks=pytest.mark.slow)])
def test_a_constructor_that_exits_stops_the_run_with_exit_2_naming_it(tmp_path, tiny_model_dir, isolation):
    r = _run(tmp_path, tiny_model_dir, "task.env=hostile_envs:ExitsWhenMade", "task.reward_fn=none",
             *([f"env.step_isolation={isolation}"] if isolation else []))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "making the environment (ExitsWhenMade) at start ended its process (exit code 9" in r.stderr
    assert "Traceback" not in r.stderr
