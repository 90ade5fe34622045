"""The off-policy corrections compared side by side on identical stale rollouts (issue 21): one table
of (preset, overrides) per method, shared by the toy lab's comparison (:mod:`benchmarks.toy_lab.corrections`)
and SmolLM2's (:mod:`benchmarks.smollm.corrections`). Plain data: importing it loads no torch."""

RELAXED = "grpo-stale-relaxed"
METHODS = {
    # name: (preset, overrides). Every correction sits on grpo-stale-relaxed (clip [0, 5], no veto), so
    # the row isolates it.
    "icepop": (RELAXED, ["loss.behavior_logprobs=trainer", "loss.correction=icepop"]),
    "mu-grpo": ("mu-grpo", []),
    RELAXED: (RELAXED, []),
    "opsm": (RELAXED, ["loss.correction=opsm"]),
    "cispo": (RELAXED, ["loss.correction=cispo"]),
    "m2po": ("m2po", []),
    "gspo": (RELAXED, ["loss.ratio_level=sequence", "loss.clip_eps_low=3e-4", "loss.clip_eps_high=4e-4"]),
    "mis_token": (RELAXED, ["loss.correction=mis_token"]),
    "mis_sequence": (RELAXED, ["loss.correction=mis_sequence"]),
}
"""GSPO with its paper's clip on the sequence ratio (arXiv 2507.18071: 3e-4 / 4e-4)."""
SOURCE = "icepop"
"""The run that generates a seed's stage (IcePop needs the trainer's recomputed behaviour log-probs, so
its stage data carries both the engine's and the trainer's); every other method replays it."""
