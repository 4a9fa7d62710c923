"""``nvfp4-emulated``: NVFP4 numerics in pure torch, so FP4 ranking fidelity can be measured on a CPU.

Same numerics as NVFP4 on Blackwell (``flowrl.quant.nvfp4_numerics``: E2M1, blocks of 16,
FP8-E4M3 block scales, fp32 global scale), fake-quantized (quantize -> dequantize) around
full-precision matmuls: it is **slower** than full precision, for fidelity only.
The weights and inputs of every ``nn.Linear`` outside the skip-list are quantized; the
activation global scale is calibrated once (static) from real prompts, never taken over
the current batch, so a sample's output does not depend on its batch-mates.

Two engines, identical numerics:

* ``"modelopt"``: a modelopt quantization backend (``register_quant_backend``) named
  ``flowrl_nvfp4_emulated`` behind modelopt's NVFP4 quantizer attributes; ``mtq.quantize``
  calibrates (``"max"``) and calls it from every enabled ``TensorQuantizer``.
* ``"torch"``: flowrl's own Linear replacement, for machines without modelopt.

``engine="auto"`` takes modelopt when it is installed.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .common import DEFAULT_SKIP, merged_copy, replace_linears
from .nvfp4_numerics import BLOCK_SIZE, nvfp4_fake_quant

MODELOPT_BACKEND = "flowrl_nvfp4_emulated"
ENGINES = ("auto", "modelopt", "torch")


def modelopt_entrypoint(inputs: torch.Tensor, quantizer) -> torch.Tensor:
    """modelopt backend entrypoint ``(inputs, TensorQuantizer) -> fake-quantized inputs``.

    The global amax is the quantizer's calibrated one; a weight quantizer that was never
    calibrated uses its weight's own maximum (static anyway), an input quantizer is an error.
    """
    amax = getattr(quantizer, "amax", None)
    role = (getattr(quantizer, "backend_extra_args", None) or {}).get("role", "input")
    if amax is None:
        if role != "weight":
            raise RuntimeError("an nvfp4-emulated input quantizer has no calibrated amax: calibrate with real "
                               "prompts before use (a batch-wide scale would couple samples)")
        amax = inputs.detach().abs().amax()
    block = (getattr(quantizer, "block_sizes", None) or {}).get(-1, BLOCK_SIZE)
    return nvfp4_fake_quant(inputs, amax, int(block))


def register_modelopt_backend() -> None:
    """Register :func:`modelopt_entrypoint` as modelopt backend ``flowrl_nvfp4_emulated`` (idempotent)."""
    from .modelopt_support import import_mtq

    import_mtq()
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )

    if not is_registered_quant_backend(MODELOPT_BACKEND):
        register_quant_backend(MODELOPT_BACKEND, modelopt_entrypoint)


class EmulatedNVFP4Linear(nn.Module):
    """``nn.Linear`` with NVFP4 fake-quantized weights and inputs (the ``"torch"`` engine).

    Starts in calibration mode: full-precision forward passes that record the input's
    absolute maximum (like modelopt's ``"max"`` calibration); :meth:`finish_calibration`
    freezes it and fake-quantizes the weight once.
    """

    def __init__(self, linear: nn.Linear, block_size: int = BLOCK_SIZE):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block_size = int(block_size)
        self.register_buffer("weight", linear.weight.detach().clone())  # [O, I]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())  # [O]
        self.register_buffer("input_amax", torch.tensor(float("nan")))  # NaN: not calibrated
        self.calibrating = True

    @torch.no_grad()
    def finish_calibration(self) -> None:
        if math.isnan(self.input_amax.item()):
            raise RuntimeError("this nvfp4-emulated layer saw no calibration data: the calibrate callable must run "
                               "real prompts through every quantized layer")
        self.weight = nvfp4_fake_quant(self.weight, self.weight.abs().amax(), self.block_size)
        self.calibrating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calibrating:  # full precision; record the input's absolute maximum (fmax skips the NaN start)
            self.input_amax = torch.fmax(self.input_amax, x.detach().abs().amax().float())
            return F.linear(x, self.weight, self.bias)
        return F.linear(nvfp4_fake_quant(x, self.input_amax, self.block_size), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}"


@dataclass
class NVFP4EmulatedQuantizer:
    """NVFP4 fake quantization on any device (CPU included), calibrated once.

    Args:
        engine: ``"auto"`` (modelopt if installed, else torch), ``"modelopt"`` or ``"torch"``.
        block_size: elements per FP8 block scale (NVFP4: 16).
        skip: fnmatch patterns of module names kept in full precision.
    """

    engine: str = "auto"
    block_size: int = BLOCK_SIZE
    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "nvfp4-emulated"
    needs_calibration: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"nvfp4-emulated engine must be one of {ENGINES}, got {self.engine!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        self.skip = tuple(self.skip)

    def resolved_engine(self) -> str:
        if self.engine != "auto":
            return self.engine
        return "modelopt" if importlib.util.find_spec("modelopt") is not None else "torch"

    def unavailable_reason(self) -> Optional[str]:
        if self.resolved_engine() == "modelopt":
            from .modelopt_support import modelopt_problem

            problem = modelopt_problem()
            if problem:
                return f"{problem}; or pass engine='torch' (same numerics without modelopt)"
        return None

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]]) -> nn.Module:
        """A private NVFP4-emulated copy of ``module``; ``calibrate(copy)`` must run real prompts
        through it (it sets the static activation scales)."""
        if calibrate is None:
            raise ValueError("nvfp4-emulated calibrates its activation scales once: pass calibrate, a callable "
                             "that runs real prompts through the module")
        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        if self.resolved_engine() == "modelopt":
            return self._quantize_modelopt(module, calibrate)
        return self._quantize_torch(module, calibrate)

    def _quantize_modelopt(self, module: nn.Module, calibrate: Callable[[nn.Module], None]) -> nn.Module:
        from .modelopt_support import linear_only_config, mtq_quantize, preset_attributes

        register_modelopt_backend()
        fp4 = preset_attributes("NVFP4_DEFAULT_CFG", "*weight_quantizer")
        fp4["block_sizes"] = {**fp4["block_sizes"], -1: self.block_size}
        weight = {**fp4, "backend": MODELOPT_BACKEND, "backend_extra_args": {"role": "weight"}}
        inputs = {**fp4, "backend": MODELOPT_BACKEND, "backend_extra_args": {"role": "input"}}
        return mtq_quantize(module, linear_only_config(weight, inputs, self.skip), calibrate)

    def _quantize_torch(self, module: nn.Module, calibrate: Callable[[nn.Module], None]) -> nn.Module:
        q = merged_copy(module)
        names = replace_linears(q, lambda n, lin: EmulatedNVFP4Linear(lin, self.block_size), self.skip)
        if not names:
            raise ValueError(f"nvfp4-emulated found no nn.Linear outside the skip-list {self.skip}; "
                             f"nothing to quantize")
        with torch.no_grad():
            calibrate(q)
        layers = [m for m in q.modules() if isinstance(m, EmulatedNVFP4Linear)]
        missing = sum(math.isnan(m.input_amax.item()) for m in layers)
        if missing:
            raise ValueError(f"{missing} of {len(layers)} nvfp4-emulated layers saw no calibration data; the "
                             f"calibrate callable must run real prompts through the module")
        for m in layers:
            m.finish_calibration()
        return q
