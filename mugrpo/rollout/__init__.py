"""Rollouts: inference engines, tasks and their rewards (what is generated and how it is scored).

The registries of this layer's extension axes live here, torch-free, so the config can list the
accepted values without importing torch (:class:`mugrpo.registry.Registry`; entries load lazily):

- :data:`TASK_KINDS` (``task.kind``): ``fn(task_cfg) -> (name, items, eval_items, correctness)``,
  the task's source (see :func:`mugrpo.rollout.tasks.build_task`);
- :data:`ENVIRONMENTS` (``task.env``): multi-turn environments (:mod:`mugrpo.rollout.envs`);
- the engines' registry is :data:`mugrpo.rollout.engines.ENGINES` (re-exported here).
"""

from mugrpo.registry import Registry
from mugrpo.rollout.engines import ENGINES

TASK_KINDS = Registry("task.kind", {
    "reasoning_gym": "mugrpo.rollout.tasks:reasoning_gym_source",
    "math": "mugrpo.rollout.tasks:math_source",
    "rows": "mugrpo.rollout.tasks:rows_source",
})
ENVIRONMENTS = Registry("task.env", {
    "calculator": "mugrpo.rollout.envs.builtin:CalculatorEnvironment",
    "multi_attempt": "mugrpo.rollout.envs.builtin:MultiAttemptEnvironment",
    "skyrl_gym": "mugrpo.rollout.envs.builtin:SkyRLGymEnvironment",
})

__all__ = ["ENGINES", "ENVIRONMENTS", "TASK_KINDS"]
