"""A tool whose module takes 3 s to import: a worker process's start-up, made long enough to see
(tests/rollout/test_calls.py)."""
import time

time.sleep(3.0)


def echo(x: int) -> int:
    """Return x.

    Args:
        x: a number
    """
    return x
