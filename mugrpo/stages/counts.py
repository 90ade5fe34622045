"""What scoring a stage's responses counted, as one typed record (not positional lists).

A sampler scores each round's batch (:func:`mugrpo.stages.samplers.score_batch`) into a
:class:`ScoreCounts`; its :meth:`~ScoreCounts.as_record` (named numbers, plain JSON) travels in the
round's record, is summed over rounds (:func:`mugrpo.stages.rounds.sum_records`, key by key) and over
ranks (:func:`mugrpo.kit.distributed.sum_named_over_ranks`), and :meth:`~ScoreCounts.metrics` turns
the sums into the stage's ``reward/*`` metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

PER_REWARD_FIELDS = ("sum", "num_errors", "num_timeouts", "num_invalid")
"""What is counted for each reward function of ``task.rewards`` (``sum``: of its scores)."""

_LEGACY_ORDER = ("num_errors", "num_timeouts", "num_invalid", "num_unparsable", "num_scored")
"""The positional layout rounds were persisted in before this record (read back on resume)."""


@dataclass
class ScoreCounts:
    num_errors: float = 0.0
    """Reward calls that raised (scored 0)."""
    num_timeouts: float = 0.0
    num_invalid: float = 0.0
    """Scores that were None, NaN or not a number (scored 0)."""
    num_unparsable: float = 0.0
    num_scored: float = 0.0
    """Responses scored."""
    num_prompts_skipped: float = 0.0
    """Prompts drawn but not generated (over ``task.max_prompt_tokens``)."""
    per_reward: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each reward function's :data:`PER_REWARD_FIELDS`, by name (several reward functions only)."""

    def as_record(self) -> dict[str, float]:
        """Named numbers: this record's fields, then ``reward/<name>/<field>`` for each function."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "per_reward"}
        for name, values in self.per_reward.items():
            out.update({f"reward/{name}/{k}": float(values.get(k, 0.0)) for k in PER_REWARD_FIELDS})
        return out

    @classmethod
    def from_record(cls, record: dict | list, names: list[str] = ()) -> "ScoreCounts":
        """The counts of :meth:`as_record` (or of a round persisted before it: the legacy positional
        list, ``names`` giving the reward functions' order)."""
        if isinstance(record, list):  # [errors, timeouts, invalid, unparsable, scored, per reward x 4 ...]
            named = dict(zip(_LEGACY_ORDER, record))
            rest = record[len(_LEGACY_ORDER):]
            for i, name in enumerate(names):
                named.update({f"reward/{name}/{k}": v for k, v in zip(PER_REWARD_FIELDS, rest[4 * i: 4 * i + 4])})
            record = named
        own = {f.name for f in fields(cls)} - {"per_reward"}
        out = cls(**{k: float(v) for k, v in record.items() if k in own})
        for key, value in record.items():
            if key.startswith("reward/"):
                name, what = key[len("reward/"):].rsplit("/", 1)
                out.per_reward.setdefault(name, {})[what] = float(value)
        return out

    @property
    def num_failed(self) -> int:
        return int(self.num_errors + self.num_timeouts + self.num_invalid)

    def metrics(self, names: list[str]) -> dict:
        """The stage's ``reward/*`` metrics (``names``: the reward functions reported one by one)."""
        out = {"reward/num_errors": int(self.num_errors), "reward/num_timeouts": int(self.num_timeouts),
               "reward/num_invalid": int(self.num_invalid),
               "reward/unparsable_frac": self.num_unparsable / max(self.num_scored, 1),
               "stage/num_prompts_skipped": int(self.num_prompts_skipped)}
        for name in names:
            own = self.per_reward.get(name, {})
            out.update({f"reward/{name}/mean": own.get("sum", 0.0) / max(self.num_scored, 1),
                        f"reward/{name}/num_errors": int(own.get("num_errors", 0)),
                        f"reward/{name}/num_timeouts": int(own.get("num_timeouts", 0)),
                        f"reward/{name}/num_invalid": int(own.get("num_invalid", 0))})
        return out
