"""``fp8``: FP8-E4M3 weights and activations with modelopt's ``FP8_DEFAULT_CFG`` attributes.

Per-tensor scales, weights and inputs of ``nn.Linear`` layers outside the skip-list,
activation scales calibrated once with ``"max"`` over real prompts (static). Meant for
Hopper-class GPUs (sm_89+ run FP8 matmuls once exported; modelopt's own forward is simulated
quantization). ``simulate_on_cpu=True`` lets modelopt's fake quantization run on a CPU too:
slower than fp32, for fidelity only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .common import DEFAULT_SKIP
from .modelopt_support import ModeloptPreset, modelopt_problem


@dataclass
class FP8Quantizer(ModeloptPreset):
    """modelopt FP8 (E4M3) fake quantization (``FP8_DEFAULT_CFG`` attributes), calibrated once.

    Args:
        simulate_on_cpu: allow the CPU (simulated, slower than fp32) when there is no CUDA GPU.
        skip: fnmatch patterns of module names kept in full precision.
    """

    simulate_on_cpu: bool = False
    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "fp8"
    PRESET: ClassVar[str] = "FP8_DEFAULT_CFG"

    def unavailable_reason(self) -> Optional[str]:
        if not torch.cuda.is_available() and not self.simulate_on_cpu:
            return ("fp8 needs a CUDA GPU (Hopper-class, sm_89+; torch.cuda.is_available() is False); pass "
                    "simulate_on_cpu=true to emulate it on the CPU (slower than fp32, fidelity only)")
        return modelopt_problem()
