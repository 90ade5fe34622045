"""A sparse binary reward for the dynamic-sampling tests (task.reward_fn=sparse_rewards:has_one)."""


def has_one(completion: str, answer: str, item: dict) -> float:
    """1 if the response contains a '1' (a random tiny model: about 1 response in 10 of 8 characters)."""
    return float("1" in completion)


def never(completion: str, answer: str, item: dict) -> float:
    """0 for every response: no group is ever informative."""
    return 0.0
