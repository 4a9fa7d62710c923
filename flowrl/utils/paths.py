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


def require_device(device: Union[str, torch.device, None], setting: str = "device") -> None:
    """Raise a one-line ``ConfigError`` when ``device`` names CUDA and no CUDA GPU is visible (torch
    would fail later with 'Found no NVIDIA driver'); ``setting`` is the name the user gave it by."""
    from ..trainers.config_base import ConfigError

    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{setting}={device} but no CUDA GPU is visible here (torch.cuda.is_available() is "
                          f"False); use {setting}=auto (GPU when there is one, else CPU) or {setting}=cpu")
