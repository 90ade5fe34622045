"""Supervised warm start (SFT), the data side: demonstrations in, token-level examples out.

- :mod:`.data`: demonstrations loaded from a dataset, rows or a file (TRL's conversational and
  prompt/completion formats, tools, tool calls, a per-message ``train`` override), checked row by row;
- :mod:`.render`: a demonstration as ids, loss mask and turn indices, rendered exactly as the
  rollout loop renders the same conversation (the mask = a trajectory's policy tokens);
- :mod:`.demos`: demonstrations without a teacher (solved calculator traces; a run's high-reward
  trajectories).

The training step that consumes :class:`mugrpo.warmstart.render.Example` lives elsewhere; this
package never imports the trainer (docs/WARMSTART.md).
"""
