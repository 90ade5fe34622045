"""Metric sinks: ``metrics.jsonl`` always (one JSON object per line, flushed per line), and
optionally TensorBoard and Weights & Biases (``log.loggers``).

A logger is an object with ``log(record: dict)`` and ``close()``; :class:`NullLogger` lets the
loop log unconditionally (ranks other than 0 get one). Non-finite floats are written as null so
every line is strict JSON. ``metrics.jsonl`` is the record of truth (``mugrpo report`` reads it);
the optional sinks get the namespaced numeric keys of each record (``loss/...``, ``eval/...``)
against the global update index, and a failure inside one of them disables it with a warning
instead of stopping training.
"""

from __future__ import annotations

import json
import math
import numbers
import sys
from pathlib import Path
from typing import Any

from mugrpo.config import ConfigError


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by None, through dicts and lists, so
    that ``json.dumps`` writes standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
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
        self._fh.write(json.dumps(json_safe(record)) + "\n")
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


def scalars(record: dict) -> dict[str, float]:
    """The namespaced (``a/b``), finite, numeric entries of a record: what dashboards plot."""
    return {k: float(v) for k, v in record.items()
            if "/" in k and isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}


def _missing(package: str, pin: str) -> ConfigError:
    return ConfigError(f"log.loggers includes {package!r} but the {package} package is not installed: "
                       f"pip install {pin} (or remove {package!r} from log.loggers)")


class TensorBoardLogger:
    """Event files under ``log_dir`` (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing("tensorboard", "tensorboard==2.21.0") from exc
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, record: dict) -> None:
        step = int(record.get("update", 0))
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run; ``mode="offline"`` needs no network (files in ``run_dir/wandb``, ``wandb sync`` later).

    Every record is logged with its ``update`` as a field and that field declared the x-axis, so
    eval and stage records at the same update line up and W&B's own step counter never has to be
    monotonic in the update (a resumed run re-logs updates past its last checkpoint).
    """

    def __init__(self, run_dir: Path, project: str, mode: str, name: str, config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb==0.31.0") from exc
        self._run = wandb.init(project=project, dir=str(run_dir), mode=mode, name=name, config=config)
        self._run.define_metric("update")
        self._run.define_metric("*", step_metric="update")

    def log(self, record: dict) -> None:
        self._run.log({**scalars(record), "update": int(record.get("update", 0))})

    def close(self) -> None:
        self._run.finish()


class MultiLogger:
    """Fans records out to several loggers; an optional one that raises is dropped with a warning."""

    def __init__(self, primary, optional: list):
        self.primary, self.optional = primary, list(optional)

    def log(self, record: dict) -> None:
        self.primary.log(record)
        for sink in list(self.optional):
            try:
                sink.log(record)
            except Exception as exc:  # noqa: BLE001 - a dashboard must never stop a training run
                print(f"[mugrpo] warning: {type(sink).__name__} failed ({exc!r}); disabled for the rest of the run",
                      file=sys.stderr)
                self.optional.remove(sink)

    def close(self) -> None:
        for sink in [self.primary, *self.optional]:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                print(f"[mugrpo] warning: closing {type(sink).__name__} failed ({exc!r})", file=sys.stderr)


def make_logger(cfg, run_dir: Path):
    """``metrics.jsonl`` in ``run_dir`` plus the sinks named in ``cfg.log.loggers``."""
    import dataclasses

    from mugrpo.run_dir import RunDir

    run_dir = Path(run_dir)
    jsonl = JsonlLogger(RunDir(run_dir).metrics)
    name = cfg.log.run_name or run_dir.resolve().name
    optional = []
    try:
        for kind in cfg.log.loggers:
            if kind == "tensorboard":
                optional.append(TensorBoardLogger(run_dir / "tensorboard"))
            elif kind == "wandb":
                optional.append(WandbLogger(run_dir, cfg.log.wandb_project, cfg.log.wandb_mode, name,
                                            dataclasses.asdict(cfg)))
    except BaseException:
        MultiLogger(jsonl, optional).close()
        raise
    return MultiLogger(jsonl, optional) if optional else jsonl
