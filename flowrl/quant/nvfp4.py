"""``nvfp4``: modelopt's NVFP4 (``NVFP4_DEFAULT_CFG`` quantizer attributes) on a CUDA GPU.

Weights and inputs of ``nn.Linear`` layers outside the skip-list (embedders and output
layers, as in modelopt's diffusers example for FLUX / SD3), blocks of 16, activation global
scales calibrated once with ``"max"`` over real prompts. modelopt's NVFP4 is simulated
quantization (CUDA / triton kernels; slower than bf16 unless exported to real FP4 GEMMs on
Blackwell, sm_100+); Sol-RL (arXiv 2604.06916) explores with Transformer Engine NVFP4 on B200.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import nn

from .common import DEFAULT_SKIP
from .modelopt_support import ModeloptPreset, modelopt_problem


@dataclass
class NVFP4Quantizer(ModeloptPreset):
    """modelopt NVFP4 fake quantization (``NVFP4_DEFAULT_CFG`` attributes), calibrated once; CUDA only.

    Args:
        skip: fnmatch patterns of module names kept in full precision.
    """

    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "nvfp4"
    PRESET: ClassVar[str] = "NVFP4_DEFAULT_CFG"

    def unavailable_reason(self) -> Optional[str]:
        if not torch.cuda.is_available():
            return ("nvfp4 needs a CUDA GPU (modelopt's NVFP4 kernels are CUDA-only; torch.cuda.is_available() is "
                    "False); on a CPU, 'nvfp4-emulated' has the same numerics")
        return modelopt_problem()

    def check_module(self, module: nn.Module) -> None:
        dev = next(module.parameters()).device
        if dev.type != "cuda":
            raise ValueError(f"nvfp4 quantizes a model on a CUDA device; this one is on {dev} (move the policy to "
                             f"cuda, or use 'nvfp4-emulated')")
