"""Pieces the model adapters share."""
from __future__ import annotations

import os
from pathlib import Path

import torch


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``u + s (c - u)`` (Ho & Salimans 2022), computed in float32."""
    u, c = uncond.float(), cond.float()
    return u + scale * (c - u)


def check_model_path(path_or_id: str, kind: str) -> None:
    """A local-looking path that does not exist gets an error that says what to do.

    Hub ids (``org/name``) pass through to ``from_pretrained``; offline, that fails in diffusers.
    """
    p = Path(os.path.expanduser(str(path_or_id)))
    looks_local = str(path_or_id).startswith((".", "/", "~")) or p.exists() or str(path_or_id).count("/") != 1
    if looks_local and not p.exists():
        raise FileNotFoundError(
            f"{kind} model path {str(path_or_id)!r} does not exist. Pass a directory written by "
            f"save_pretrained (e.g. `flowrl make-tiny {kind} DIR` for a tiny offline one) or a hub id "
            f"like 'stabilityai/stable-diffusion-3.5-medium'.")
