"""A small named registry: name -> implementation, imported lazily on first use.

Every extension axis of mugrpo is one of these (engines, loss surrogates, ratio levels,
aggregations, task kinds, environments). An entry is either a ``"module:attr"`` string, imported
the first time it is looked up (so listing the names never imports torch or vLLM), or the object
itself (what :meth:`Registry.register` gives a user's own extension).

This module is torch-free and knows nothing of what it holds; each registry lives beside (or, when
the config must read its names without torch, in a torch-free module next to) its implementations.
"""

from __future__ import annotations

import importlib
from typing import Any


class RegistryError(ValueError):
    """An unknown name; the message lists the registered ones."""


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
        """Add ``name`` -> ``target`` (an object, or a ``"module:attr"`` string imported on first use).

        An existing name is refused unless ``replace``: silently shadowing a built-in is a bug magnet."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what}: a registry name must be a non-empty string, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(f"{self.what}: {name!r} is already registered; pass replace=True to override it")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"{self.what}: {target!r} must be 'module:attr' (or the object itself)")
        self._entries[name] = target
        self._loaded.pop(name, None)

    def target(self, name: str) -> Any:
        """The raw entry (a ``"module:attr"`` string or the object), without importing it."""
        self._check(name)
        return self._entries[name]

    def get(self, name: str) -> Any:
        """The implementation registered as ``name``, imported on first use."""
        self._check(name)
        if name not in self._loaded:
            entry = self._entries[name]
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
