"""What every config section shares: the section names and the field helper.

Imported by ``config.py`` and ``offline_config.py`` (neither imports the other's module at
import time through this one), so the two have no import cycle.
"""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

# the recipe's top-level sections, in the order Config lists them (config.SECTIONS maps them to classes)
SECTION_NAMES = ("model", "sampler", "reward", "train", "data", "logging", "offline")


def _h(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING):
    """A dataclass field with help text (``metadata["help"]``), a default or a default factory."""
    kw = {"metadata": {"help": text}}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, **kw)
    return field(default=default, **kw)
