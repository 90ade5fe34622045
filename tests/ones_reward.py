"""A reward for tests: the fraction of the response's characters that are "1".

A randomly initialised character-level model starts near 1/100 and learns to emit more "1"s
within a few updates, so "reward rises" is checkable in seconds on a CPU.
"""


def reward(completion: str, answer: str, item: dict) -> float:
    return sum(c == "1" for c in completion) / max(len(completion), 1)
