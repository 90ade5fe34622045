"""Typed run configuration, in three parts, re-exported here so ``from mugrpo.config import ...`` works.

- :mod:`mugrpo.config.schema`: the dataclasses (one per section, each validating itself; the model,
  task, rollout and env sections in :mod:`mugrpo.config.rollout_sections`) and the accepted-value
  tuples, with :mod:`mugrpo.config.rules` beside it: :func:`validate` (every section,
  then the one place for rules that span sections), :func:`stage_shape` and :func:`resume_safe_keys`
  (fields marked ``resume_safe``);
- :mod:`mugrpo.config.io`: YAML files, ``key=value`` overrides, coercion, renamed keys, the dump and
  the field reference;
- :mod:`mugrpo.config.presets`: named sets of overrides.

:mod:`mugrpo.config.plan` derives the schedule from a Config; it imports the schema, never the reverse.
"""

from mugrpo.config.io import (RENAMED_KEYS, dump_yaml, field_docs, from_dict, load_config, parse_override,
                              read_config_file, read_run_config, set_value, to_dict)
from mugrpo.config.presets import PRESETS
from mugrpo.config.rules import resume_safe_keys, stage_shape, validate
from mugrpo.config.schema import (ADAPTIVE_GUARDS, AGGREGATIONS, BEHAVIOR_LOGPROBS, CLIP_MODES, DEFAULT_FEW_SHOT,
                                  DEFAULT_INSTRUCTION, LOGGERS, LORA_DEFAULT_TARGETS, RATIO_LEVELS, VETO_NORMALIZERS,
                                  VETO_SCOPES, CheckpointConfig, Config, EnvConfig, EvalConfig, LogConfig, LoraConfig,
                                  LossConfig, ModelConfig, OptimConfig, ParallelConfig, RolloutConfig,
                                  ScheduleConfig, TaskConfig, TrainConfig, VllmConfig,
                                  WarmstartConfig)
from mugrpo.errors import ConfigError

__all__ = [
    "ADAPTIVE_GUARDS", "AGGREGATIONS", "BEHAVIOR_LOGPROBS", "CLIP_MODES", "DEFAULT_FEW_SHOT", "DEFAULT_INSTRUCTION",
    "LOGGERS", "LORA_DEFAULT_TARGETS", "PRESETS", "RATIO_LEVELS", "RENAMED_KEYS", "VETO_NORMALIZERS", "VETO_SCOPES",
    "CheckpointConfig", "Config", "ConfigError", "EnvConfig", "EvalConfig", "LogConfig", "LoraConfig", "LossConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "RolloutConfig", "ScheduleConfig", "TaskConfig", "TrainConfig",
    "VllmConfig", "WarmstartConfig", "dump_yaml", "field_docs", "from_dict", "load_config", "parse_override",
    "read_config_file",
    "resume_safe_keys", "set_value", "stage_shape", "to_dict", "validate",
]
