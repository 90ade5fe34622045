"""mugrpo: Mu-GRPO and its baselines (GRPO, stale GRPO, M2PO) as presets of one staged trainer."""

__version__ = "0.1.0"
