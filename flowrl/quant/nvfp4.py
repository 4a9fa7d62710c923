"""``nvfp4``: NVFP4 (E2M1 values, blocks of 16, FP8 block scales) on a CUDA GPU.

Weights and inputs of ``nn.Linear`` layers outside the skip-list (embedders and output
layers stay in full precision, as in modelopt's diffusers example for FLUX / SD3), activation
global scales calibrated once over real prompts (static). Two kernels (option ``kernel``):

* ``"modelopt"``: modelopt's ``NVFP4_DEFAULT_CFG`` fake quantization (quantize-dequantize
  around bf16 matmuls): runs on any CUDA GPU, **simulated** (slower than bf16; labelled so in
  every benchmark table, log line and JSON).
* ``"scaled_mm"``: real FP4 GEMMs (:mod:`flowrl.quant.nvfp4_kernels`), Blackwell (sm_100+)
  only, checked against the emulated numerics before use.
* ``"auto"`` (default): ``scaled_mm`` where it runs, else ``modelopt``.

Sol-RL (arXiv 2604.06916) explores with Transformer Engine NVFP4 on B200. On a CPU,
``nvfp4-emulated`` has the same numerics.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from .calibration import record_input_amax
from .common import DEFAULT_SKIP, is_skipped, merged_copy, replace_linears
from .kernels import SIMULATED, tag_kernel
from .modelopt_support import ModeloptPreset, modelopt_problem
from .nvfp4_kernels import NVFP4Linear, nvfp4_gemm_problem

KERNELS = ("auto", "modelopt", "scaled_mm")


@dataclass
class NVFP4Quantizer(ModeloptPreset):
    """NVFP4 exploration copy on CUDA (module doc), calibrated once.

    Args:
        kernel: ``"auto"``, ``"modelopt"`` (simulated) or ``"scaled_mm"`` (real FP4, sm_100+).
        skip: fnmatch patterns of module names kept in full precision.
    """

    kernel: str = "auto"
    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "nvfp4"
    PRESET: ClassVar[str] = "NVFP4_DEFAULT_CFG"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel not in KERNELS:
            raise ValueError(f"nvfp4 kernel must be one of {KERNELS} ('scaled_mm': real FP4 GEMMs on sm_100+; "
                             f"'modelopt': simulated), got {self.kernel!r}")

    def resolved_kernel(self, device: Optional[torch.device] = None) -> str:
        """``kernel`` with ``"auto"`` resolved for ``device`` (default: the current CUDA device)."""
        if self.kernel != "auto":
            return self.kernel
        if not torch.cuda.is_available():
            return "modelopt"
        dev = device or torch.device("cuda", torch.cuda.current_device())
        return "scaled_mm" if nvfp4_gemm_problem(str(dev)) is None else "modelopt"

    def unavailable_reason(self) -> Optional[str]:
        if not torch.cuda.is_available():
            return ("nvfp4 needs a CUDA GPU (modelopt's NVFP4 kernels and real FP4 GEMMs are CUDA-only; "
                    "torch.cuda.is_available() is False); on a CPU, 'nvfp4-emulated' has the same numerics and "
                    "'int8-dynamic' runs real int8 kernels")
        if self.resolved_kernel() == "scaled_mm":
            return nvfp4_gemm_problem(str(torch.device("cuda", torch.cuda.current_device())))
        return modelopt_problem()

    def check_module(self, module: nn.Module) -> None:
        dev = next(module.parameters()).device
        if dev.type != "cuda":
            raise ValueError(f"nvfp4 quantizes a model on a CUDA device; this one is on {dev} (move the policy to "
                             f"cuda, or use 'nvfp4-emulated')")

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]]) -> nn.Module:
        """A private NVFP4 copy of ``module``; ``calibrate(copy)`` runs real prompts through it once."""
        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        self.check_module(module)
        device = next(module.parameters()).device
        if self.resolved_kernel(device) == "modelopt":
            q = super().quantize(module, calibrate)
            why = "" if self.kernel == "modelopt" else f"; no real FP4 GEMMs here: {nvfp4_gemm_problem(str(device))}"
            return tag_kernel(q, real=False, kernel=f"{SIMULATED}: modelopt NVFP4 fake quantization "
                                                    f"(quantize-dequantize around bf16 matmuls){why}")
        problem = nvfp4_gemm_problem(str(device))
        if problem:
            raise RuntimeError(problem)
        q = merged_copy(module)
        names = [n for n, m in q.named_modules() if isinstance(m, nn.Linear) and not is_skipped(n, self.skip)]
        if not names:
            raise ValueError(f"nvfp4 found no nn.Linear outside the skip-list {self.skip}; nothing to quantize")
        amax = record_input_amax(q, names, calibrate, "nvfp4")
        replace_linears(q, lambda n, lin: NVFP4Linear(lin, amax[n]), self.skip)
        return tag_kernel(q, real=True, kernel="torch scaled_mm NVFP4 GEMMs (float4_e2m1fn_x2, E4M3 block scales; "
                                               "input quantization unfused)")
