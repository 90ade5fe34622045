"""The loss's extension axes as registries, and the accepted names of its options; torch-free.

The config reads the accepted values from here without importing torch, and the math modules
(:mod:`mugrpo.algo.losses`, :mod:`mugrpo.algo.veto`) read them instead of importing the config.
Each registry maps a config value to the function or object that implements it
(:class:`mugrpo.registry.Registry`, imported lazily):

- :data:`SURROGATES` (``loss.clip_mode``): ``fn(log_ratio, advantages, mask, settings) ->
  (token_loss, clipped_low, clipped_high, extra_metrics)``, see :func:`mugrpo.algo.losses.ppo_surrogate`.
- :data:`RATIO_MODES` (``loss.ratio_level``): ``fn(log_ratio, keep) -> log_ratio`` [B, T], the ratio the
  surrogate sees (token-level, or GSPO's sequence-level mean).
- :data:`AGGREGATORS` (``loss.aggregation``): an :class:`mugrpo.algo.aggregation.Aggregation`, which
  reduces token losses AND counts the step's normaliser (tokens or sequences), so the trainer never
  branches on the aggregation's name.

A user's own option: ``SURROGATES.register("mine", my_fn)`` (or ``"pkg.module:fn"``) before building
the config. The tuples below are the built-in names as of import (kept under the names the config
used); call ``.names()`` to include later registrations.
"""

from __future__ import annotations

from mugrpo.registry import Registry

SURROGATES = Registry("loss.clip_mode", {
    "ppo": "mugrpo.algo.losses:ppo_surrogate",
    "m2po": "mugrpo.algo.losses:m2po_surrogate",
})
RATIO_MODES = Registry("loss.ratio_level", {
    "token": "mugrpo.algo.losses:token_log_ratio",
    "sequence": "mugrpo.algo.losses:sequence_log_ratio",
})
AGGREGATORS = Registry("loss.aggregation", {
    "token-mean": "mugrpo.algo.aggregation:TOKEN_MEAN",
    "seq-mean-token-mean": "mugrpo.algo.aggregation:SEQ_MEAN_TOKEN_MEAN",
    "seq-mean-token-sum-norm": "mugrpo.algo.aggregation:SEQ_MEAN_TOKEN_SUM_NORM",
})

CLIP_MODES = SURROGATES.names()
RATIO_LEVELS = RATIO_MODES.names()
AGGREGATIONS = AGGREGATORS.names()
VETO_SCOPES = ("none", "trigger", "suffix", "suffix_nontrigger", "sequence")
"""The veto's scopes (:func:`mugrpo.algo.veto.veto_mask`): a closed set, each a line of that function."""
