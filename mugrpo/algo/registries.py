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
- :data:`CORRECTIONS` (``loss.correction``): ``fn(inputs, settings) -> Correction | None``, an
  off-policy correction (:mod:`mugrpo.algo.corrections`: a keep mask, a detached weight, metrics),
  composed with the surrogate after the veto; ``none`` returns None. Each entry declares its own
  parameters (:class:`mugrpo.registry.Param`, read by the entry as ``settings.<name>``).

A user's own option: ``SURROGATES.register("mine", my_fn)`` (or ``"pkg.module:fn"``) before building
the config. The tuples below are the built-in names as of import (kept under the names the config
used); call ``.names()`` to include later registrations.
"""

from __future__ import annotations

import math

from mugrpo.registry import Option, Param, Registry

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

_INF = math.inf
_MIS_LOW = Param("mis_low", 0.5, "Masked IS: lower bound of the kept band of pi_theta / pi_engine (token or geometric "
                 "mean).", lambda v: 0 < v <= 1, "in (0, 1]")
_MIS_HIGH = Param("mis_high", 2.0, "Masked IS: upper bound of the kept band.", lambda v: 1 <= v < _INF,
                  "a finite number >= 1")

CORRECTIONS = Registry("loss.correction", {
    "none": "mugrpo.algo.corrections:no_correction",
    "opsm": Option("mugrpo.algo.corrections:opsm_entry", params=(
        Param("opsm_delta", 0.1, "OPSM: an A<0 response is dropped when its mean k1 log(pi_engine / pi_theta) exceeds "
              "this (> 0).", lambda v: 0 < v < _INF, "a finite number > 0"),)),
    "icepop": Option("mugrpo.algo.corrections:icepop_entry", needs=frozenset({"trainer_logprobs"}), params=(
        Param("icepop_low", 0.5, "IcePop: lower bound alpha of the kept band of pi_old / pi_engine (INTELLECT-3: 0.5).",
              lambda v: 0 < v <= 1, "in (0, 1]"),
        Param("icepop_high", 5.0, "IcePop: upper bound beta of the kept band (INTELLECT-3: 5).",
              lambda v: 1 <= v < _INF, "a finite number >= 1"))),
    "cispo": Option("mugrpo.algo.corrections:cispo_entry", params=(
        Param("cispo_eps_low", 1.0, "CISPO: the weight's lower bound is max(1 - cispo_eps_low, 0) (1.0 -> 0: none, "
              "the paper's).", lambda v: 0 <= v < _INF, "a finite number >= 0"),
        Param("cispo_eps_high", 4.0, "CISPO: the weight's upper bound is 1 + cispo_eps_high (4.0 -> 5, SkyRL / "
              "ScaleRL).", lambda v: 0 <= v < _INF, "a finite number >= 0"))),
    "mis_token": Option("mugrpo.algo.corrections:mis_token_entry", params=(_MIS_LOW, _MIS_HIGH)),
    "mis_sequence": Option("mugrpo.algo.corrections:mis_sequence_entry", params=(_MIS_LOW, _MIS_HIGH)),
})
"""Each correction's parameters (``loss.<name>``) and needs are declared here, with its entry: the config
grows a key per parameter, checks it with the parameter's own rule and documents it from its text; an
option that ``needs`` ``trainer_logprobs`` is refused at start without ``loss.behavior_logprobs=trainer``."""

CLIP_MODES = SURROGATES.names()
RATIO_LEVELS = RATIO_MODES.names()
AGGREGATIONS = AGGREGATORS.names()
CORRECTION_NAMES = CORRECTIONS.names()
VETO_SCOPES = ("none", "trigger", "suffix", "suffix_nontrigger", "sequence")
"""The veto's scopes (:func:`mugrpo.algo.veto.veto_mask`): a closed set, each a line of that function."""
