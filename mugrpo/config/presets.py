"""Presets: named sets of overrides of the schema's defaults (docs/ALGORITHM.md section 8).

Everything a preset sets stays overridable by a config file or ``key=value``. Nothing else lives here.
"""

from __future__ import annotations

from typing import Any

# docs/ALGORITHM.md section 8. Each preset is a set of overrides; everything stays overridable.
_STRICT = {"loss.clip_mode": "ppo", "loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.2, "loss.veto_scope": "none"}
_STALE = {"schedule.num_stages": 4, "schedule.updates_per_stage": None}
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {**_STRICT, "schedule.updates_per_stage": 4, "schedule.num_stages": None},
    "grpo-stale": {**_STRICT, **_STALE},
    "grpo-stale-relaxed": {**_STALE, "loss.clip_mode": "ppo", "loss.clip_eps_low": 1.0,
                           "loss.clip_eps_high": 4.0, "loss.veto_scope": "none"},
    "m2po": {**_STALE, "loss.clip_mode": "m2po", "loss.veto_scope": "none"},
    "mu-grpo": {**_STALE, "loss.clip_mode": "ppo", "loss.clip_eps_low": 1.0, "loss.clip_eps_high": 4.0,
                "loss.veto_scope": "suffix"},
}
