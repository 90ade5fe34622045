"""Metric sinks: ``metrics.jsonl`` always (one JSON object per line, flushed per line).

A logger is an object with ``log(record: dict)`` and ``close()``; :class:`NullLogger` lets the
loop log unconditionally (ranks other than 0 get one). Non-finite floats are written as null so
every line is strict JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class NullLogger:
    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh = open(self.path, "a", buffering=1)

    def log(self, record: dict) -> None:
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict]:
    """Every complete line of a metrics.jsonl (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
