"""The small checks every config section uses, and the field metadata a resume reads."""
from __future__ import annotations

from typing import Any

from mugrpo.errors import ConfigError

SAFE = {"resume_safe": True}
"""Field metadata: a resume may change this key (it does not alter the experiment)."""


def check(ok: bool, key: str, accepted: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is out of range; accepted: {accepted}")


def check_registered(value: Any, registry, key: str) -> None:
    """``value`` must name an entry of ``registry`` (built-in or registered by the user)."""
    if not (isinstance(value, str) and value in registry):
        raise ConfigError(f"{key}={value!r} is not a known option; accepted: {', '.join(registry.names())}")

