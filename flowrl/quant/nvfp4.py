"""``nvfp4``: modelopt's NVFP4 (``NVFP4_DEFAULT_CFG`` quantizer attributes) on a CUDA GPU.

Weights and inputs of ``nn.Linear`` layers outside the skip-list (embedders and output
layers, as in modelopt's diffusers example for FLUX / SD3), blocks of 16, activation global
scales calibrated once with ``"max"`` over real prompts. modelopt's NVFP4 is simulated
quantization (CUDA / triton kernels; slower than bf16 unless exported to real FP4 GEMMs on
Blackwell, sm_100+); Sol-RL (arXiv 2604.06916) explores with Transformer Engine NVFP4 on B200.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from .common import DEFAULT_SKIP


@dataclass
class NVFP4Quantizer:
    """modelopt NVFP4 fake quantization, calibrated once; CUDA only.

    Args:
        skip: fnmatch patterns of module names kept in full precision.
    """

    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "nvfp4"
    needs_calibration: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.skip = tuple(self.skip)

    def unavailable_reason(self) -> Optional[str]:
        from .modelopt_support import modelopt_problem

        if not torch.cuda.is_available():
            return ("nvfp4 needs a CUDA GPU (modelopt's NVFP4 kernels are CUDA-only; torch.cuda.is_available() is "
                    "False); on a CPU, 'nvfp4-emulated' has the same numerics")
        return modelopt_problem()

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]]) -> nn.Module:
        from .modelopt_support import mtq_quantize

        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        if calibrate is None:
            raise ValueError("nvfp4 calibrates its activation scales once: pass calibrate, a callable that runs "
                             "real prompts through the module")
        dev = next(module.parameters()).device
        if dev.type != "cuda":
            raise ValueError(f"nvfp4 quantizes a model on a CUDA device; this one is on {dev} (move the policy to "
                             f"cuda, or use 'nvfp4-emulated')")
        return mtq_quantize(module, self.config(), calibrate)

    def config(self) -> dict:
        """The modelopt config: NVFP4 attributes of ``NVFP4_DEFAULT_CFG`` on Linear weights and inputs,
        the skip-list disabled."""
        from .modelopt_support import linear_only_config, preset_attributes

        fp4 = preset_attributes("NVFP4_DEFAULT_CFG", "*weight_quantizer")
        inputs = preset_attributes("NVFP4_DEFAULT_CFG", "*input_quantizer")
        return linear_only_config(fp4, inputs, self.skip)
