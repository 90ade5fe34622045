"""mugrpo: Mu-GRPO and its baselines (GRPO, stale GRPO, M2PO) as presets of one staged trainer.

The Python API (:mod:`mugrpo.api`): ``mugrpo.train(config, reward_funcs=..., train_dataset=...)``,
``mugrpo.sft(config, data=...)`` (a supervised warm start alone), ``mugrpo.evaluate(model, tasks, ...)``
(``mugrpo eval``), ``mugrpo.make_config``, ``mugrpo.from_trl``, ``mugrpo.Config``. Imported on first
use, so that ``import mugrpo`` (and the ``mugrpo`` command's help) stays fast.
"""

__version__ = "0.1.0"

_API = {"train": "mugrpo.api", "sft": "mugrpo.api", "evaluate": "mugrpo.api", "make_config": "mugrpo.api",
        "from_trl": "mugrpo.api",
        "TrainResult": "mugrpo.api", "Config": "mugrpo.config", "load_config": "mugrpo.config"}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'mugrpo' has no attribute {name!r}")
