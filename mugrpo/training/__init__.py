"""The training step and the staged loop: batching, forward, stage data, checkpoints, FSDP2."""
