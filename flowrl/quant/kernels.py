"""What a quantized copy really runs: real low-precision GEMMs, or a simulation of their numerics.

A backend tags the copy it returns (:func:`tag_kernel`) with ``real_kernels`` (True: the matmuls
run in int8 / FP8 / FP4 on hardware that has such units, so a speed-up is possible; False:
quantize-dequantize around full-precision matmuls, or a CPU reference of a GPU kernel, for
fidelity only, never a speed-up) and a short description of the kernel. :func:`kernel_info`
reads the tag back, with a conservative default for untagged copies: only ``none`` (full
precision) and ``int8-dynamic`` (fbgemm int8 GEMMs) count as real without a tag.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

KERNEL_ATTR = "flowrl_kernel"
SIMULATED = "simulated"
# backends whose copies run real kernels even untagged (their files predate the tag)
_UNTAGGED_REAL = {"none": "full precision (the policy's own dtype)", "int8-dynamic": "fbgemm int8 GEMMs (CPU)"}


def tag_kernel(module: nn.Module, *, real: bool, kernel: str) -> nn.Module:
    """Record on ``module`` whether it runs real low-precision kernels and which; returns it."""
    setattr(module, KERNEL_ATTR, {"real_kernels": bool(real), "kernel": str(kernel)})
    return module


def kernel_info(backend: str, module: Optional[nn.Module] = None) -> dict:
    """``{"real_kernels": bool, "kernel": str}`` of a copy built by ``backend`` (a name or a
    ``name:key=value`` spec; ``"full"`` is the unquantized policy)."""
    tag = getattr(module, KERNEL_ATTR, None) if module is not None else None
    if tag is not None:
        return dict(tag)
    name = backend.split(":", 1)[0]
    if name == "full":
        return {"real_kernels": True, "kernel": "full precision (the policy's own dtype)"}
    if name in _UNTAGGED_REAL:
        return {"real_kernels": True, "kernel": _UNTAGGED_REAL[name]}
    return {"real_kernels": False, "kernel": f"{SIMULATED} (untagged copy: assumed quantize-dequantize)"}


def display_label(backend: str, info: dict) -> str:
    """The name a table or log line shows: ``"nvfp4 (simulated)"`` unless the kernels are real."""
    return backend if info.get("real_kernels") else f"{backend} ({SIMULATED})"


def cuda_capability(device: Optional[torch.device | str] = None) -> Optional[tuple[int, int]]:
    """``(major, minor)`` of a CUDA device (default: the current one), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(dev))  # type: ignore[return-value]


def describe_capability(cap: Optional[tuple[int, int]]) -> str:
    return "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"
