"""Errors that end a command with a message for the user (what was wrong, what to do), never a
traceback. They live at the bottom of the import graph, so any module may raise them and the CLI can
catch them all without importing the modules that raise them (and torch with those)."""

from __future__ import annotations


class UserError(Exception):
    """Base of every error caused by the user's input or environment; the CLI exits 2 with its message."""


class ConfigError(UserError, ValueError):
    """A bad key or value in the configuration; the message names the key and the fix."""


class TaskError(UserError, ValueError):
    """A dataset, task or reward that cannot be used; the message says what is wrong and the fix."""
