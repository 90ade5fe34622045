"""The <tool_call> protocol, the call runner and the tool environments (mugrpo.rollout.envs.tools)."""

import json
import threading
import time

import pytest

from mugrpo.rollout.calls import CallRunner
from mugrpo.rollout.engines.base import Completion, SamplingConfig
from mugrpo.rollout.envs.tools import (COUNT_KEYS, FactoryEnvironment, ToolEnvironment, parse_tool_calls,
                                       protocol_text, tool_schemas)
from mugrpo.rollout.multiturn import LoopContext, LoopLimits, run_trajectories
from mugrpo.rollout.tasks import Item


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def boom(x: str) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"cannot {x}")


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---------------------------------------------------------------------------------------------
# Parsing.


def test_parser_reads_every_call_in_order():
    text = f"Let me add. {call('add', a=1, b=2)} and {call('boom', x='fly')} done"
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                              ("boom", {"x": "fly"}, None)]


def test_parser_accepts_arguments_as_a_json_string_and_missing_arguments():
    calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
                             '<tool_call>{"name": "f"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None), ("f", {}, None)]


def test_parser_no_call_is_an_empty_list():
    assert parse_tool_calls("The answer is \\boxed{3}.") == []


@pytest.mark.parametrize("body, says", [
    ("{not json}", "not valid JSON"),
    ('["add", 1]', "JSON object"),
    ('{"arguments": {"a": 1}}', "JSON object"),          # no name
    ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
    ('{"name": "add", "arguments": "1, 2"}', "not a JSON object"),
])
def test_parser_marks_malformed_calls(body, says):
    (c,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert c.error is not None and says in c.error


def test_parser_counts_an_unclosed_call():
    calls = parse_tool_calls(call("add", a=1, b=1) + ' <tool_call>{"name": "add", "argu')
    assert calls[0].error is None and calls[1].error.startswith("unclosed")


# ---------------------------------------------------------------------------------------------
# Schemas and the protocol text.


def test_schemas_come_from_the_signature_and_docstring():
    (schema,) = tool_schemas([add])
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first."}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert json.dumps(schema) in protocol_text([schema]) and "<tool_call>" in protocol_text([schema])


def test_a_tool_without_docstring_is_refused_by_name():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="tool 'bare'.*docstring"):
        tool_schemas([bare])


# ---------------------------------------------------------------------------------------------
# Failure modes: each answered with {"error": ...} and counted.


def counts(**nonzero) -> dict:
    return {**dict.fromkeys(COUNT_KEYS, 0), **nonzero}


def totals(metadata: dict) -> dict:
    """The step's total counts (the per-tool ones are tested on their own below)."""
    return {k: metadata[k] for k in COUNT_KEYS}


def test_a_good_call_returns_its_result():
    env = ToolEnvironment([add, boom])
    result = env.step(call("add", a=2, b=3))
    assert result.observations == [{"role": "tool", "name": "add", "content": "5"}]
    assert (result.reward, result.done, totals(result.metadata)) == (0.0, False, counts(tool_calls=1))


@pytest.mark.parametrize("action, key, says", [
    (call("boom", x="fly"), "tool_exceptions", "RuntimeError: cannot fly"),
    (call("subtract", a=1, b=2), "tool_unknown", "unknown tool 'subtract'"),
    (call("add", a=1), "tool_bad_args", "missing a required argument: 'b'"),
    (call("add", a=1, b=2, c=3), "tool_bad_args", "unexpected keyword argument 'c'"),
    ("<tool_call>{add(1, 2)}</tool_call>", "tool_bad_args", "not valid JSON"),
])
def test_each_failure_is_an_error_observation_and_counted(action, key, says):
    env = ToolEnvironment([add, boom])
    result = env.step(action)
    (obs,) = result.observations
    assert obs["role"] == "tool" and says in json.loads(obs["content"])["error"]
    assert totals(result.metadata) == counts(tool_calls=1, tool_errors=1, **{key: 1})
    assert not result.done  # the model reads the error and may try again


def test_mixed_calls_are_counted_each():
    env = ToolEnvironment([add, boom])
    result = env.step(call("add", a=1, b=1) + call("boom", x="a") + call("nope") + "<tool_call>x</tool_call>")
    # 4 calls: 1 fine, 1 raised, 1 unknown, 1 bad JSON -> 3 errors
    assert totals(result.metadata) == counts(tool_calls=4, tool_errors=3, tool_exceptions=1, tool_unknown=1, tool_bad_args=1)
    assert result.observations[0]["content"] == "2"


def test_a_hung_tool_times_out_and_the_step_returns():
    env = ToolEnvironment([nap], timeout_s=0.2)
    start = time.monotonic()
    result = env.step(call("nap", seconds=5.0))
    elapsed = time.monotonic() - start
    assert elapsed < 2.0  # bounded by the timeout (0.2 s), not the 5 s sleep; slack for a loaded CPU
    assert "did not return within 0.2 s" in json.loads(result.observations[0]["content"])["error"]
    assert totals(result.metadata) == counts(tool_calls=1, tool_errors=1, tool_timeouts=1)


def test_slow_calls_run_concurrently_in_the_pool():
    # 6 calls of 0.5 s with 6 workers overlap: all 6 are running at once at some moment (run one
    # after another, at most 1 would be). A property of the pool, not a speed target.
    running, peak, lock = [0], [0], threading.Lock()

    def nap_counted(seconds: float) -> str:
        """Sleep, counting how many naps run at once.

        Args:
            seconds: How long.
        """
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(seconds)
        with lock:
            running[0] -= 1
        return f"slept {seconds}"

    env = ToolEnvironment([nap_counted], timeout_s=10.0, runner=CallRunner(6))
    result = env.step("".join(call("nap_counted", seconds=0.5) for _ in range(6)))
    assert [o["content"] for o in result.observations] == ["slept 0.5"] * 6
    assert peak[0] == 6


def test_the_runner_bound_holds_and_each_call_is_timed_from_its_start():
    # 1 worker, 3 calls of 0.4 s, timeout 1.0 s from each call's own start: they run one after
    # another (peak 1) and all finish, the third 1.2 s after submission, since waiting for the slot
    # does not count. A call of 3 s with the same timeout is abandoned, the one queued behind it runs.
    runner, running, peak = CallRunner(1), [0], [0]
    lock = threading.Lock()

    def work():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.4)
        with lock:
            running[0] -= 1
        return "ok"

    outcomes = runner.run([work, work, work], timeout_s=1.0)
    assert [o.value for o in outcomes] == ["ok", "ok", "ok"] and all(o.ok for o in outcomes)
    assert peak[0] == 1
    late = runner.run([lambda: time.sleep(3), work], timeout_s=1.0)
    assert late[0].timed_out and late[1].value == "ok"


def test_a_timed_out_call_gives_its_slot_back():
    runner = CallRunner(1)
    first = runner.run([lambda: time.sleep(3)], timeout_s=0.1)
    assert first[0].timed_out and not first[0].ok
    assert runner.run([lambda: 7], timeout_s=1.0)[0].value == 7  # would time out if the slot were still held


def test_a_turn_without_a_call_is_the_final_answer():
    env = ToolEnvironment([add])
    result = env.step("So the answer is \\boxed{5}.")
    assert (result.observations, result.reward, result.done) == ([], 0.0, True)


def test_a_call_never_ends_the_trajectory_the_turn_limit_does():
    # The environment declares max_turns = 2 and is never done while the model calls a tool; the
    # rollout loop (which allows 4) must end the trajectory after exactly 2 policy turns, counted as
    # "turn_limit", with the tool's result appended once, between the two turns.
    class AlwaysCalls:
        def generate(self, prompts, sampling, progress=None, max_new_tokens=None):
            return [[Completion([5], [-0.5], "stop") for _ in range(sampling.n)] for _ in prompts]

    seen = []

    def render(messages, ended_on_eos):
        seen.append([m["content"] for m in messages])
        return [7, 8]

    ctx = LoopContext(AlwaysCalls(), None, LoopLimits(max_turns=4, max_response_tokens=64), render_env_turn=render,
                      decode=lambda ids: call("add", a=1, b=1), eos=[2])
    [t] = run_trajectories(ctx, [[1]], [ToolEnvironment([add], max_turns=2)], SamplingConfig(max_new_tokens=4))
    assert (t.end_reason, t.num_turns) == ("turn_limit", 2)
    assert seen == [["2"]] and t.response_ids == [5, 7, 8, 5] and t.turns == [0, -1, -1, 1]
    assert t.metadata["tool_calls"] == 2.0 and t.metadata["tool_errors"] == 0.0


def test_results_that_are_not_text_are_rendered():
    def info(key: str) -> dict:
        """Look up a key.

        Args:
            key: The key.
        """
        return {"key": key, "values": [1, 2]}

    result = ToolEnvironment([info]).step(call("info", key="k"))
    assert json.loads(result.observations[0]["content"]) == {"key": "k", "values": [1, 2]}


def test_async_tools_are_awaited():
    async def double(x: int) -> int:
        """Double it.

        Args:
            x: The number.
        """
        return 2 * x

    assert ToolEnvironment([double]).step(call("double", x=21)).observations[0]["content"] == "42"


@pytest.mark.parametrize("kwargs, says", [({"max_turns": 0}, "max_turns"), ({"timeout_s": 0}, "timeout_s")])
def test_bad_settings_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        ToolEnvironment([add], **kwargs)


def test_duplicate_tool_names_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        ToolEnvironment([add, add])


# ---------------------------------------------------------------------------------------------
# TRL environment_factory objects.


class Counter:
    """A TRL-style environment: public methods are tools, reset(**row), get_reward()."""

    def reset(self, target: int, **row) -> str:
        self.value, self.target = 0, target
        return f" Reach {target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0

    def _private(self):
        return "not a tool"


def test_factory_object_methods_become_tools_and_reset_appends_text():
    env = FactoryEnvironment(Counter, max_turns=5)
    assert [t.__name__ for t in env.tools()] == ["increment"]
    messages = env.reset(Item("Count up.", "3", {"target": 3}), seed=0)
    assert messages == [{"role": "user", "content": "Count up. Reach 3."}]


def test_factory_reward_sums_to_the_last_get_reward():
    env = FactoryEnvironment(Counter, max_turns=5)
    env.reset(Item("q", "", {"target": 3}), seed=0)
    rewards = [env.step(call("increment", by=by)).reward for by in (3, 1, -1)]
    # value 3 (reward 1), 4 (0), 3 (1): step rewards are the changes 1, -1, +1; their sum is 1 = get_reward()
    assert rewards == [1.0, -1.0, 1.0] and sum(rewards) == 1.0
    final = env.step("done")
    assert final.done and final.reward == 0.0  # unchanged since the last step


def test_counts_per_tool_and_the_tool_use_fractions():
    # One step: add(1, 2) works, add with a wrong argument fails, nap is never called, and an unknown
    # tool counts only in the totals.
    env = ToolEnvironment([add, nap])
    result = env.step(call("add", a=1, b=2) + call("add", a=1, c=2) + call("nope"))
    m = result.metadata
    assert (m["tool_calls"], m["tool_errors"]) == (3, 2)
    assert (m["tool_calls/add"], m["tool_errors/add"], m["tool_calls/nap"], m["tool_errors/nap"]) == (2, 1, 0, 0)
    # Three trajectories: the first made those 3 calls (2 failed), the second 1 good call, the third
    # none: 2 of 3 called a tool; 2 of 4 calls were answered without an error.
    from mugrpo.rollout.multiturn import Trajectory, loop_metrics

    trajs = [Trajectory([1], env, 2, metadata=dict(m)), Trajectory([1], env, 2, metadata={"tool_calls": 1.0}),
             Trajectory([1], env, 2, metadata={"tool_calls": 0.0})]
    for t in trajs:
        t.end_reason = "done"
    out = loop_metrics(trajs)
    assert out["env/num_with_tool_call"] == 2 and out["env/tool_call_frac"] == pytest.approx(2 / 3)
    assert out["env/tool_success_frac"] == pytest.approx(0.5) and out["env/tool_calls/add"] == 2


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_tool_that_ends_its_process_ends_the_step_naming_the_tool(isolation):
    import guard_tools
    from mugrpo.rollout.calls import ProcessExit

    env = ToolEnvironment([guard_tools.die, guard_tools.add], timeout_s=20.0, runner=CallRunner(2, isolation=isolation))
    with pytest.raises(ProcessExit, match=r"tool 'die' ended its process \(exit code 3\)"):
        env.step('<tool_call>{"name": "die", "arguments": {"x": 0}}</tool_call>')
    ok = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')  # the tools serve on
    assert ok.observations[0]["content"] == "5"
