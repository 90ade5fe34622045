"""A small named registry: name -> implementation, imported lazily on first use.

Every extension axis of mugrpo is one of these (engines, loss surrogates, ratio levels,
aggregations, task kinds, environments). An entry is either a ``"module:attr"`` string, imported
the first time it is looked up (so listing the names never imports torch or vLLM), or the object
itself (what :meth:`Registry.register` gives a user's own extension).

An entry may own settings: an :class:`Option` is the target plus the :class:`Param` s it reads
(declared once, there: the config grows a key for each, validates it with the param's own check,
and documents it in docs/CONFIG.md from the param's text) and flags such as ``needs`` (what it
requires of the rest of the config). So adding an option with a parameter is its implementation
plus its registry line.

This module is torch-free and knows nothing of what it holds; each registry lives beside (or, when
the config must read its names without torch, in a torch-free module next to) its implementations.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable


class RegistryError(ValueError):
    """An unknown name; the message lists the registered ones."""


@dataclass(frozen=True)
class Param:
    """A numeric setting an option reads, under the key ``<section>.<name>`` of the config."""

    name: str
    default: float
    doc: str
    valid: Callable[[float], bool] = lambda value: math.isfinite(value)
    accepted: str = "a finite number"
    """What ``valid`` accepts, in words (for the error message)."""


@dataclass(frozen=True)
class Option:
    """A registry entry with settings: the implementation (an object or ``"module:attr"``), the
    parameters it reads, and what it needs of the rest of the config (e.g. ``"trainer_logprobs"``)."""

    target: Any
    params: tuple[Param, ...] = ()
    needs: frozenset[str] = frozenset()


class Registry:
    """``what`` names the setting that picks an entry (e.g. ``"loss.aggregation"``), for messages."""

    def __init__(self, what: str, entries: dict[str, Any] | None = None):
        self.what = what
        self._entries: dict[str, Any] = dict(entries or {})
        self._loaded: dict[str, Any] = {}

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, name: str, target: Any, *, replace: bool = False) -> None:
        """Add ``name`` -> ``target`` (an object, a ``"module:attr"`` string imported on first use, or an
        :class:`Option` with its parameters; a parameter's config key exists only for options
        registered before the config module is imported).

        An existing name is refused unless ``replace``: silently shadowing a built-in is a bug magnet."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what}: a registry name must be a non-empty string, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.what}: {name!r} is already registered; pass replace=True to override it")
        raw = target.target if isinstance(target, Option) else target
        if isinstance(raw, str) and ":" not in raw:
            raise ValueError(f"{self.what}: {raw!r} must be 'module:attr' (or the object itself)")
        self._entries[name] = target
        self._loaded.pop(name, None)

    def target(self, name: str) -> Any:
        """The raw entry (a ``"module:attr"`` string or the object), without importing it."""
        self._check(name)
        entry = self._entries[name]
        return entry.target if isinstance(entry, Option) else entry

    def params(self, name: str) -> tuple[Param, ...]:
        """The parameters option ``name`` reads (none for a plain entry)."""
        self._check(name)
        entry = self._entries[name]
        return entry.params if isinstance(entry, Option) else ()

    def needs(self, name: str) -> frozenset[str]:
        self._check(name)
        entry = self._entries[name]
        return entry.needs if isinstance(entry, Option) else frozenset()

    def all_params(self) -> tuple[Param, ...]:
        """Every option's parameters, each name once, in registration order (options may share one:
        it must then be the same declaration)."""
        seen: dict[str, Param] = {}
        for name in self._entries:
            for param in self.params(name):
                if param.name in seen and seen[param.name] != param:
                    raise ValueError(f"{self.what}: options declare the parameter {param.name!r} twice, differently")
                seen.setdefault(param.name, param)
        return tuple(seen.values())

    def get(self, name: str) -> Any:
        """The implementation registered as ``name``, imported on first use."""
        self._check(name)
        if name not in self._loaded:
            entry = self.target(name)
            if isinstance(entry, str):
                module, attr = entry.split(":", 1)
                entry = getattr(importlib.import_module(module), attr)
            self._loaded[name] = entry
        return self._loaded[name]

    def _check(self, name: str) -> None:
        if name not in self._entries:
            raise RegistryError(f"unknown {self.what} {name!r}; choose one of {', '.join(self._entries) or '(none)'}")

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._entries)})"
