"""Metrics sinks, console progress, and `mugrpo report`."""
