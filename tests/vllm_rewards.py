"""Reward functions for the vLLM end-to-end test (loaded through ``task.reward_fn=vllm_rewards:...``)."""


def fraction_of_ones(completion: str, answer: str, item: dict) -> float:
    """Share of the response's characters that are "1": a tiny random model can learn it in a few updates."""
    if not completion:
        return 0.0
    return sum(c == "1" for c in completion) / len(completion)
