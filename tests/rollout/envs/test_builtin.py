"""Built-in environments: calculator, multi-attempt feedback, the skyrl-gym adapter, the names."""

import json
from fractions import Fraction

import pytest

from mugrpo.rollout.envs import ENVIRONMENTS, env_factory
from mugrpo.rollout.envs.builtin import (CalculatorEnvironment, MultiAttemptEnvironment, SkyRLGymEnvironment,
                                         calculate, evaluate_arithmetic)
from mugrpo.rollout.tasks import Item

# ---------------------------------------------------------------------------------------------
# The calculator.


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14),                  # precedence: 3*4 = 12, + 2
    ("(2 + 3) * 4", 20),                # 5 * 4
    ("7 / 2", Fraction(7, 2)),          # exact: 3.5
    ("1 / 3 + 1 / 6", Fraction(1, 2)),  # 2/6 + 1/6 = 3/6, exact (floats would give 0.49999...)
    ("-(4 - 10) * -2", -12),            # -(-6) = 6, * -2
    ("123456789 * 987654321", 121932631112635269),
    ("0.5 * 4", 2),
])
def test_arithmetic_by_hand(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize("expression, text", [("7 / 2", "3.5"), ("6 / 3", "2"), ("1 / 3", "0.333333333333"),
                                              ("2 - 5", "-3")])
def test_calculate_formats_results(expression, text):
    assert calculate(expression) == text


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "2 ** 10", "abs(-1)", "x + 1", "'a' * 3", "True + 1", "1 if 1 else 2",
    "[1, 2]", "2 // 3", "5 % 2", "1 +",
])
def test_anything_but_arithmetic_is_refused(expression):
    with pytest.raises(ValueError):
        evaluate_arithmetic(expression)


def test_overlong_expressions_are_refused():
    with pytest.raises(ValueError, match="longer than 200"):
        evaluate_arithmetic("+".join(["9"] * 101))  # 201 characters


def test_calculator_environment_answers_calls_and_counts_errors():
    env = CalculatorEnvironment(max_turns=3)
    env.reset(Item("What is 12 * (3 + 4)?", "84"), seed=0)
    assert [t.__name__ for t in env.tools()] == ["calculate"]
    ok = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>')
    assert ok.observations == [{"role": "tool", "name": "calculate", "content": "84"}] and not ok.done
    bad = env.step('<tool_call>{"name": "calculate", "arguments": {"expression": "1 / 0"}}</tool_call>')
    assert "ZeroDivisionError" in json.loads(bad.observations[0]["content"])["error"]
    assert bad.metadata["tool_exceptions"] == 1 and bad.metadata["tool_errors"] == 1
    final = env.step("So it is \\boxed{84}.")
    assert final.done and final.reward == 0.0  # the task's correctness scores the final answer


# ---------------------------------------------------------------------------------------------
# Multi-attempt feedback, on scripted actions.


def exact(text: str, item: Item) -> float:
    return float(text.strip() == item.answer)


def test_multi_attempt_feedback_until_correct():
    env = MultiAttemptEnvironment(max_attempts=3, score=exact)
    assert env.reset(Item("2+2?", "4"), seed=0) is None and env.max_turns == 3
    first = env.step("5")
    assert (first.observations, first.reward, first.done) == ([{"role": "user", "content": "Incorrect, try again."}],
                                                             0.0, False)
    second = env.step("4")
    assert (second.observations, second.reward, second.done) == ([], 0.0, True)
    assert env.metrics() == {"num_attempts": 2.0, "num_solved": 1.0}


def test_multi_attempt_stops_at_the_limit_with_no_reward():
    env = MultiAttemptEnvironment(max_attempts=2, score=exact)
    env.reset(Item("2+2?", "4"), seed=0)
    assert not env.step("5").done
    last = env.step("6")
    assert (last.observations, last.reward, last.done) == ([], 0.0, True)
    assert env.metrics() == {"num_attempts": 2.0, "num_solved": 0.0}


def test_multi_attempt_discount_penalises_later_successes():
    env = MultiAttemptEnvironment(max_attempts=4, discount=0.5, score=exact)
    env.reset(Item("2+2?", "4"), seed=0)
    rewards = [env.step(a).reward for a in ("1", "2", "4")]
    # correct at attempt 3: total should be 0.5 ** 2 = 0.25 = task correctness 1 + env penalty -0.75
    assert rewards == [0.0, 0.0, -0.75]


def test_multi_attempt_default_score_is_math_verify_of_the_boxed_answer():
    env = MultiAttemptEnvironment(max_attempts=2)
    env.reset(Item("Half of 1?", "1/2"), seed=0)
    assert not env.step("It is \\boxed{0.4}").done
    assert env.step("It is \\boxed{\\frac{1}{2}}").done and env.solved


@pytest.mark.parametrize("kwargs, says", [({"max_attempts": 0}, "max_attempts"), ({"discount": 0.0}, "discount"),
                                          ({"discount": 1.5}, "discount")])
def test_multi_attempt_bad_settings(kwargs, says):
    with pytest.raises(ValueError, match=says):
        MultiAttemptEnvironment(**kwargs)


# ---------------------------------------------------------------------------------------------
# skyrl-gym's environments, unchanged (the package is pinned in requirements.lock).


def test_skyrl_gsm8k_multi_turn_on_scripted_actions():
    env = SkyRLGymEnvironment("gsm8k_multi_turn", max_turns=3)
    assert env.reset(Item("What is 6*7?", "42"), seed=0) is None  # its init keeps the prompt: the task renders it
    first = env.step("6*7 = 41\n#### 41")
    # wrong but well formatted: skyrl's format score 0.2 / max_turns = 0.2 / 3
    assert first.reward == pytest.approx(0.2 / 3) and not first.done
    assert first.observations[0]["role"] == "user" and "#### ANSWER" in first.observations[0]["content"]
    second = env.step("Sorry: 6*7 = 42\n#### 42")
    assert (second.reward, second.done, second.observations) == (1.0, True, [])
    assert env.metrics() == {"steps": 2.0}
    env.close()


def test_skyrl_gsm8k_multi_turn_stops_at_its_turn_limit():
    env = SkyRLGymEnvironment("gsm8k_multi_turn", max_turns=2)
    env.reset(Item("What is 6*7?", "42"), seed=0)
    assert not env.step("no idea").done
    last = env.step("still none")
    assert (last.reward, last.done) == (0.0, True)  # no "#### n": no format score either


def test_skyrl_single_turn_envs_score_once():
    gsm8k = SkyRLGymEnvironment("gsm8k")
    gsm8k.reset(Item("What is 6*7?", "42"), seed=0)
    out = gsm8k.step("#### 42")
    assert (out.reward, out.done) == (1.0, True)
    aime = SkyRLGymEnvironment("aime")
    aime.reset(Item("What is 6*7?", "42"), seed=0)
    out = aime.step("6 * 7 = 42\nAnswer: 42")  # aime reads DAPO's "Answer: ..." line
    # aime's metadata has acc (a flag: kept as 1.0) and pred (a string: dropped, it cannot be summed)
    assert (out.reward, out.done) == (1.0, True) and out.metadata == {"acc": 1.0}
    aime = SkyRLGymEnvironment("aime")
    aime.reset(Item("What is 6*7?", "42"), seed=0)
    assert aime.step("Answer: 41").reward == -1.0  # aime scores a wrong answer -1


def test_skyrl_keeps_chat_message_prompts():
    env = SkyRLGymEnvironment("gsm8k_multi_turn")
    messages = [{"role": "system", "content": "Answer as '#### n'."}, {"role": "user", "content": "6*7?"}]
    assert env.reset(Item("6*7?", "42", {}, messages), seed=0) == messages


def test_skyrl_online_envs_are_refused():
    with pytest.raises(ValueError, match="'search' is not one that runs offline"):
        SkyRLGymEnvironment("search")


# ---------------------------------------------------------------------------------------------
# Names.


def test_every_named_environment_resolves():
    assert env_factory("calculator", max_turns=2)().max_turns == 2
    assert env_factory("multi_attempt", max_attempts=5)().max_turns == 5
    assert env_factory("skyrl_gym", env_id="gsm8k")().env_id == "gsm8k"
    # the built-in names are there; the registry may hold more (a new built-in, a user's): not pinned
    assert {"calculator", "multi_attempt", "skyrl_gym"} <= set(ENVIRONMENTS.names())
    assert ENVIRONMENTS.get("calculator") is CalculatorEnvironment


@pytest.mark.parametrize("name, kwargs, says", [
    ("calculater", {}, "unknown task.env .calculater.; choose one of .*calculator"),
    ("calculator", {"max_turn": 2}, "unexpected keyword argument 'max_turn'"),
    ("skyrl_gym", {"env_id": "text2sql"}, "not one that runs offline"),
])
def test_bad_environment_names_and_arguments(name, kwargs, says):
    with pytest.raises(ValueError, match=says):
        env_factory(name, **kwargs)


def test_the_docs_example_environment_runs():
    # docs/ENVIRONMENTS.md "Writing your own": its code, run on scripted guesses.
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "ENVIRONMENTS.md").read_text()
    code = doc.split("## Writing your own", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(code, namespace)
    env = namespace["GuessTheNumber"]()
    assert env.reset(Item("Guess.", "37"), seed=0) is None
    steps = [env.step(a) for a in ("50", "\\boxed{50}", "\\boxed{20}", "\\boxed{37}")]
    assert [s.observations[0]["content"] if s.observations else None for s in steps] == [
        "Give your guess as \\boxed{n}.", "No: the number is lower.", "No: the number is higher.", None]
    assert [(s.reward, s.done) for s in steps] == [(0.0, False)] * 3 + [(1.0, True)]
