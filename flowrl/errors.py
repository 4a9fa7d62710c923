"""The errors every layer raises for bad settings: imports nothing from flowrl, so any module may use them
(and the command line's error table, ``flowrl.command_line.user_errors``, imports them from here)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A recipe, override or command-line setting is invalid; the message says which and how to fix it."""


class BenchError(ValueError):
    """A benchmark (``flowrl bench``) cannot run as asked (unknown variant, pipeline, flag combination); the
    message says what to give instead."""
