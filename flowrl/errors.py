"""The error every layer raises for bad settings: imports nothing from flowrl, so any module may use it."""
from __future__ import annotations


class ConfigError(ValueError):
    """A recipe, override or command-line setting is invalid; the message says which and how to fix it."""
