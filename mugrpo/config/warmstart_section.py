"""The ``warmstart`` config section: a supervised warm start (SFT on demonstrations) before RL, or
alone (``mugrpo sft``). Read by :mod:`mugrpo.warmstart.phase` only; docs/WARMSTART.md.

The warm start shares the rest of the config with the RL run: the model (``model.*``, ``lora.*``),
the optimizer's settings other than its learning rate (``optim.*``; no warmup), the seed and
precision (``train.*``), the micro-batch token budget (``schedule.micro_batch_tokens``), the task's
prompt rendering (``task.*``) and ``checkpoint.keep_last`` / ``max_bad_updates``. This module knows
nothing about models or tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mugrpo.config.checks import SAFE, check


@dataclass
class WarmstartConfig:
    data: Optional[str] = None
    """Demonstrations to warm-start on: a ``.jsonl``, ``.json`` (a list) or ``.parquet`` file of TRL
    conversational or prompt/completion rows (docs/WARMSTART.md), or the run directory of an earlier
    run, whose own trajectories with reward >= ``min_reward`` are trained on (rejection sampling).
    null: no warm start. With it set, ``mugrpo train`` first trains on them in RUN_DIR/warmstart/ and
    starts RL from the result."""
    min_reward: float = 1.0
    """With ``data`` a run directory: keep the trajectories of its complete stages whose reward is
    at least this (and that ended by themselves, not at the token budget)."""
    epochs: int = 1
    """Passes over the demonstrations (each in its own seeded order), unless ``steps`` is set."""
    steps: Optional[int] = None
    """Optimizer steps of the warm start; null: ``epochs`` x ceil(demonstrations / ``batch_size``)."""
    lr: float = 1e-5
    """The warm start's learning rate (``optim.lr`` is RL's); the schedule is ``optim.lr_schedule``
    over the warm start's steps, without warmup."""
    batch_size: int = 8
    """Demonstrations per optimizer step. The loss is the mean NLL over the step's trained tokens,
    so ``schedule.micro_batch_tokens`` changes speed and memory, never the step."""
    max_length: Optional[int] = None
    """Tokens per demonstration (prompt + response); a longer one keeps its first ``max_length`` and
    one with no trained token left is dropped (both counted at start). null: the model's context."""
    split_calls: bool = False
    """Rewrite an assistant message with k parallel tool calls as k turns of one call each (a policy
    turn makes one call); false: such a message is refused."""
    checkpoint_every: int = field(default=50, metadata=SAFE)
    """Checkpoint every N steps (and at a stop request); 0: only at the end."""

    def validate(self) -> None:
        if self.data is not None:
            check(isinstance(self.data, str) and self.data.strip() != "", "warmstart.data",
                  "a path to a .jsonl, .json or .parquet file of demonstrations, a run directory, or null",
                  self.data)
        check(isinstance(self.min_reward, (int, float)) and not isinstance(self.min_reward, bool)
              and abs(self.min_reward) < float("inf"), "warmstart.min_reward", "a finite number", self.min_reward)
        check(self.epochs >= 1, "warmstart.epochs", "an integer >= 1", self.epochs)
        if self.steps is not None:
            check(self.steps >= 1, "warmstart.steps", "an integer >= 1 or null", self.steps)
        check(0 < self.lr < float("inf"), "warmstart.lr", "a finite number > 0", self.lr)
        check(self.batch_size >= 1, "warmstart.batch_size", "an integer >= 1", self.batch_size)
        if self.max_length is not None:
            check(self.max_length >= 2, "warmstart.max_length",
                  "an integer >= 2 (a prompt token and a trained one) or null", self.max_length)
        check(self.checkpoint_every >= 0, "warmstart.checkpoint_every", "an integer >= 0 (0 = only at the end)",
              self.checkpoint_every)
