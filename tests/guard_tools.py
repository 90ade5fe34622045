"""Module-level tools for tests/rollout/test_calls.py: a worker process must import them (spawn)."""
import os
import re
import time


def backtrack(n: int) -> str:
    """A catastrophic regex: exponential backtracking in C, holding the GIL the whole time.

    Args:
        n: How many 'a's.
    """
    return str(bool(re.match(r"(a+)+$", "a" * n + "b")))


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: One.
        b: The other.
    """
    return a + b


def fail(x: int) -> int:
    """Raise.

    Args:
        x: Ignored.
    """
    raise ValueError(f"bad x {x}")


def die(x: int) -> int:
    """Kill the process it runs in.

    Args:
        x: Ignored.
    """
    os._exit(3)


def sleep(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "slept"


class Picky(Exception):
    """An exception that pickles but does not unpickle (its constructor needs two arguments)."""

    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


def raise_picky(x: int) -> int:
    """Raise an exception that does not unpickle.

    Args:
        x: Ignored.
    """
    raise Picky(x, x)
