"""Evaluation: held-out accuracy during training, `mugrpo eval`, evaluation sets and metrics."""
