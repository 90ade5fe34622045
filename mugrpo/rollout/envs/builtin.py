"""Built-in environments: a calculator tool, multi-attempt feedback, and skyrl-gym's environments.

- :class:`CalculatorEnvironment`: arithmetic with a ``calculate(expression)`` tool (a safe, ast-based
  evaluator of ``+ - * /`` and parentheses; no ``eval``). The environment gives no reward of its
  own: the task's rewards score the final answer (``\\boxed{}``) as in single-turn training.
- :class:`MultiAttemptEnvironment`: a wrong answer gets "Incorrect, try again." and another attempt,
  up to ``max_attempts`` policy turns.
- :class:`SkyRLGymEnvironment`: a skyrl-gym text environment (``gsm8k``, ``gsm8k_multi_turn``,
  ``aime``: the ones that run offline) made by ``skyrl_gym.make`` and driven unchanged.

Scoring here means the task's correctness ``score(text, item) -> float`` (1.0 = correct), the same
function the task scores the final turn with; environments that need it take it as ``score``
(default: math-verify of the last ``\\boxed{}`` against ``item.answer``).
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Callable, Optional

from mugrpo.rollout.envs.base import Environment, StepResult
from mugrpo.rollout.calls import CallRunner
from mugrpo.rollout.envs.tools import ToolEnvironment

__all__ = ["calculate", "evaluate_arithmetic", "CalculatorEnvironment", "MultiAttemptEnvironment",
           "SkyRLGymEnvironment", "SKYRL_OFFLINE"]

MAX_EXPRESSION_CHARS = 200
"""Longer expressions are refused: with + - * / only, this bounds the size of every number."""

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of ``expression`` (numbers, ``+ - * /``, parentheses, unary minus).

    Raises ValueError for anything else (names, calls, ``**``, ...) and ZeroDivisionError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)  # a float literal is exact in binary: Fraction keeps that value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}")


def _format(value: Fraction) -> str:
    """An integer as itself; otherwise a decimal (rounded to 12 significant digits)."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.12g}"


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "12 * (3 + 4) - 5 / 2".
    """
    return _format(evaluate_arithmetic(expression))


class CalculatorEnvironment(ToolEnvironment):
    """Arithmetic with the :func:`calculate` tool; the task's correctness scores the final answer."""

    def __init__(self, max_turns: int = 4, timeout_s: float = 5.0, runner: Optional[CallRunner] = None):
        super().__init__([calculate], max_turns=max_turns, timeout_s=timeout_s, runner=runner)


def _default_score(text: str, item) -> float:
    from mugrpo.rollout.tasks import _math_verify

    return _math_verify(text, item)


class MultiAttemptEnvironment(Environment):
    """A wrong answer gets ``feedback`` and another attempt, up to ``max_attempts`` turns.

    The reward is the correctness of the last attempt, which the task's rewards give when they score
    the final turn; this environment adds no reward when ``discount`` is 1 (the default). With
    ``discount`` < 1, a correct answer at attempt k (1-based) earns ``discount ** (k - 1)`` in all:
    this environment's reward is the penalty ``discount ** (k - 1) - 1`` on that step, so that the
    sum with the task's correctness (1) is the discounted value. A wrong last attempt earns 0.
    """

    def __init__(self, max_attempts: int = 3, discount: float = 1.0, feedback: str = "Incorrect, try again.",
                 score: Optional[Callable] = None):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        self.max_turns = self.max_attempts = max_attempts
        self.discount, self.feedback = discount, feedback
        self.score = score or _default_score
        self.item, self.attempts, self.solved = None, 0, False

    def reset(self, item, seed: int) -> None:
        self.item, self.attempts, self.solved = item, 0, False
        return None

    def step(self, action: str) -> StepResult:
        self.attempts += 1
        self.solved = float(self.score(action, self.item)) >= 1.0
        if self.solved:
            return StepResult([], self.discount ** (self.attempts - 1) - 1.0, True)
        if self.attempts >= self.max_attempts:
            return StepResult([], 0.0, True)
        return StepResult([{"role": "user", "content": self.feedback}], 0.0, False)

    def metrics(self) -> dict[str, float]:
        # Only here, not also in step metadata: the loop sums both into env/<key>.
        return {"num_attempts": float(self.attempts), "num_solved": float(self.solved)}


SKYRL_OFFLINE = ("gsm8k", "gsm8k_multi_turn", "aime")
"""skyrl-gym environments that need nothing but a ground truth (the others call a retrieval
server, a SQL database or run code)."""


class SkyRLGymEnvironment(Environment):
    """A skyrl-gym ``BaseTextEnv``, unchanged: ``skyrl_gym.make(env_id, env_config, extras)`` with
    the item's answer as the ground truth (under both ``reward_spec`` and ``reward_model``, the two
    keys its environments read), ``init`` on the prompt, then ``step`` forwarded. Its per-step
    rewards are the environment reward; ``get_metrics()`` are the metrics."""

    preload_modules = ("skyrl_gym",)
    """Imported once by the fork server under ``env.step_isolation=process``, not by each worker."""

    def __init__(self, env_id: str, env_config: Optional[dict] = None, max_turns: int = 5):
        if env_id not in SKYRL_OFFLINE:
            raise ValueError(f"skyrl-gym environment {env_id!r} is not one that runs offline; "
                             f"use one of {list(SKYRL_OFFLINE)}")
        try:
            import skyrl_gym  # noqa: F401 - checked here, at start, not in the middle of a stage
        except ImportError as exc:
            raise ValueError("the skyrl_gym environment needs the skyrl-gym package: "
                             "pip install 'skyrl-gym==0.4.0' (or the mugrpo[envs] extra)") from exc
        self.env_id, self.env_config, self.max_turns = env_id, dict(env_config or {}), max_turns
        self.env = None

    def reset(self, item, seed: int) -> Optional[list[dict]]:
        import skyrl_gym

        truth = {"ground_truth": item.answer}
        extras = {"reward_spec": truth, "reward_model": truth, "max_turns": self.max_turns,
                  "extra_info": item.entry.get("extra_info") or {}}
        self.env = skyrl_gym.make(self.env_id, env_config=self.env_config, extras=extras)
        given = [dict(m) for m in item.messages] if item.messages else [{"role": "user", "content": item.question}]
        messages, _ = self.env.init([dict(m) for m in given])
        return None if messages == given and not item.messages else list(messages)

    def step(self, action: str) -> StepResult:
        out = self.env.step(action)
        metadata = {k: float(v) for k, v in (out.get("metadata") or {}).items() if _is_number(v)}
        return StepResult(list(out.get("observations") or []), float(out.get("reward") or 0.0),
                          bool(out.get("done")), metadata)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()

    def metrics(self) -> dict[str, float]:
        if self.env is None:
            return {}
        return {k: float(v) for k, v in self.env.get_metrics().items() if _is_number(v)}


def _is_number(value) -> bool:
    # skyrl-gym metadata mixes numbers and flags with strings (aime's "pred"): only those sum
    return isinstance(value, (int, float))
