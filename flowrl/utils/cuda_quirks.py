"""Workarounds for faults of CUDA libraries that flowrl has seen, applied where it trains or measures on a GPU.

* cuDNN attention backward, torch 2.11 (CUDA 13.0): an illegal memory access in the backward pass of
  FLUX.1-dev's transformer (bf16, 24 heads x 128, 1,152 tokens, 3 rows, LoRA, gradient checkpointing) on
  an H200 (2026-11-27, ``flowrl plan --measure`` on ``recipes/flux_group_pickscore.yaml``); the same pass
  with cuDNN's ``scaled_dot_product_attention`` backend off ran (flash attention) and matched the plan.
  On torch 2.11 flowrl turns that backend off for the process (``FLOWRL_CUDNN_SDPA=1`` keeps it).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

_APPLIED: list[str] = []


def cudnn_sdpa_problem(torch_version: str, device_type: str, keep: bool = False) -> Optional[str]:
    """Why cuDNN attention should be off for ``torch_version`` on ``device_type`` (None: leave it on)."""
    if device_type != "cuda" or keep or not torch_version.startswith("2.11."):
        return None
    return (f"torch {torch_version}: cuDNN attention off (its backward crashed with an illegal memory access on "
            f"FLUX.1-dev shapes on an H200); flash / memory-efficient attention run instead. "
            f"FLOWRL_CUDNN_SDPA=1 keeps cuDNN attention")


def apply_cuda_workarounds(device: torch.device | str) -> list[str]:
    """Apply the workarounds for this torch on ``device`` (once per process); the notices, each said once."""
    device = torch.device(device)
    why = cudnn_sdpa_problem(torch.__version__, device.type, os.environ.get("FLOWRL_CUDNN_SDPA") == "1")
    if why is None:
        return []
    torch.backends.cuda.enable_cudnn_sdp(False)
    if why not in _APPLIED:
        _APPLIED.append(why)
        print(f"[flowrl] {why}", file=sys.stderr, flush=True)
    return [why]
