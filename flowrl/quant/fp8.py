"""``fp8``: FP8-E4M3 weights and activations with modelopt's ``FP8_DEFAULT_CFG`` attributes.

Per-tensor scales, weights and inputs of ``nn.Linear`` layers outside the skip-list,
activation scales calibrated once with ``"max"`` over real prompts (static). Meant for
Hopper-class GPUs (sm_89+ run FP8 matmuls once exported; modelopt's own forward is simulated
quantization). ``simulate_on_cpu=True`` lets modelopt's fake quantization run on a CPU too:
slower than fp32, for fidelity only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from .common import DEFAULT_SKIP


@dataclass
class FP8Quantizer:
    """modelopt FP8 (E4M3) fake quantization, calibrated once.

    Args:
        simulate_on_cpu: allow the CPU (simulated, slower than fp32) when there is no CUDA GPU.
        skip: fnmatch patterns of module names kept in full precision.
    """

    simulate_on_cpu: bool = False
    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "fp8"
    needs_calibration: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.skip = tuple(self.skip)

    def unavailable_reason(self) -> Optional[str]:
        from .modelopt_support import modelopt_problem

        if not torch.cuda.is_available() and not self.simulate_on_cpu:
            return ("fp8 needs a CUDA GPU (Hopper-class, sm_89+; torch.cuda.is_available() is False); pass "
                    "simulate_on_cpu=true to emulate it on the CPU (slower than fp32, fidelity only)")
        return modelopt_problem()

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]]) -> nn.Module:
        from .modelopt_support import mtq_quantize

        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        if calibrate is None:
            raise ValueError("fp8 calibrates its activation scales once: pass calibrate, a callable that runs real "
                             "prompts through the module")
        return mtq_quantize(module, self.config(), calibrate)

    def config(self) -> dict:
        """The modelopt config: ``FP8_DEFAULT_CFG`` attributes on Linear weights and inputs, the
        skip-list disabled."""
        from .modelopt_support import linear_only_config, preset_attributes

        weight = preset_attributes("FP8_DEFAULT_CFG", "*weight_quantizer")
        inputs = preset_attributes("FP8_DEFAULT_CFG", "*input_quantizer")
        return linear_only_config(weight, inputs, self.skip)
