"""Supervised warm start (SFT): demonstrations in, token-level examples out, and the phase that trains on them.

- :mod:`.data`: demonstrations loaded from a dataset, rows or a file (TRL's conversational and
  prompt/completion formats, tools, tool calls, a per-message ``train`` override), checked row by row;
- :mod:`.render`: a demonstration as ids, loss mask and turn indices, rendered exactly as the
  rollout loop renders the same conversation (the mask = a trajectory's policy tokens);
- :mod:`.demos`: demonstrations without a teacher (solved calculator traces; a run's high-reward
  trajectories);
- :mod:`.source`: where ``warmstart.data``'s examples come from (a file, rows given from Python, or
  an earlier run's directory: rejection sampling with ``warmstart.min_reward``), checked at start.

- :mod:`.loss`: the masked token-mean NLL and the seeded data order (pure);
- :mod:`.phase`: the training phase (``mugrpo sft``, and the warm start of ``mugrpo train``), built
  from the RL trainer's parts (:mod:`mugrpo.kit.model_parts`, batching, forward, checkpoints).

This package never imports the trainer (:mod:`mugrpo.training.trainer` imports :mod:`.phase`);
docs/WARMSTART.md.
"""
