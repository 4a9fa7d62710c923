"""Where flowrl keeps its caches, and which device "auto" means."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

HOME_ENV = "FLOWRL_HOME"


def flowrl_home() -> Path:
    """flowrl's cache directory: ``$FLOWRL_HOME``, default ``~/.cache/flowrl`` (read on every call)."""
    return Path(os.environ.get(HOME_ENV, Path.home() / ".cache" / "flowrl"))


def default_cache_dir() -> Path:
    """Alias of :func:`flowrl_home` (the digits base model and classifier live here)."""
    return flowrl_home()


def resolve_device(device: Union[str, torch.device, None] = "auto") -> torch.device:
    """``"auto"`` (or None) -> ``cuda`` when a CUDA GPU is visible, else ``cpu``; anything else as given."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)

