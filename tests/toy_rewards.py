"""Reward functions for tests (referenced as task.reward_fn=toy_rewards:NAME)."""
import sys
import time


def frac_ones(completion: str, answer: str, item: dict) -> float:
    """Fraction of response characters that are '1': dense, learnable by a tiny model in seconds."""
    return sum(c == "1" for c in completion) / len(completion) if completion else 0.0


def raises(completion, answer, item):
    raise RuntimeError("boom")


def hangs(completion, answer, item):
    time.sleep(60)
    return 1.0


def returns_none(completion, answer, item):
    return None


def returns_nan(completion, answer, item):
    return float("nan")


def returns_text(completion, answer, item):
    return "1.0"


def exits(completion, answer, item):
    sys.exit()


def interrupted(completion, answer, item):
    raise KeyboardInterrupt


def huge(completion, answer, item):
    return 1e39  # finite as a Python float, inf as float32


def segfaults(completion, answer, item):
    import ctypes

    return ctypes.string_at(0)  # reads address 0: SIGSEGV


def flaky(completion, answer, item):
    """Fails on some responses, deterministically by their text: raises on a '2', returns None (an
    invalid value) on a '3', else :func:`frac_ones`; so a stage's reward/num_errors and num_invalid
    are counts a test can compare across runs."""
    if "2" in completion:
        raise RuntimeError("flaky reward: a '2'")
    if "3" in completion:
        return None
    return frac_ones(completion, answer, item)


def hard_exits(completion, answer, item):
    import os

    os._exit(3)  # skips every finally and handler: the run would end without a message
