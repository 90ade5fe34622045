"""Rollouts: inference engines, tasks and their rewards (what is generated and how it is scored)."""
