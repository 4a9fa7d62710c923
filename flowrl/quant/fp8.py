"""``fp8``: FP8-E4M3 weights and activations.

Three kernels (option ``kernel``):

* ``"scaled_mm"`` (default): every ``nn.Linear`` outside the skip-list becomes an
  :class:`~flowrl.quant.fp8_linear.FP8Linear`, a real FP8 GEMM (``torch._scaled_mm``) on sm_89+
  GPUs (Ada, Hopper, Blackwell): weights quantized once (per output channel by default),
  input scales calibrated once on real prompts (``amax / 448``), bf16 out, bias added in the
  GEMM's epilogue; everything else (attention, norms, embedders, output layers) stays bf16.
  ``simulate_on_cpu=true`` runs the same numerics on a CPU, where ``_scaled_mm`` is a
  reference implementation: labelled simulated, slower than fp32, for fidelity only.
* ``"modelopt"``: nvidia-modelopt's ``FP8_DEFAULT_CFG`` fake quantization (quantize-dequantize
  around bf16 matmuls, per-tensor scales): labelled simulated, slower than bf16; on a CPU
  with ``simulate_on_cpu=true``.
* ``"torchao"``: torchao's row-wise dynamic float8 (:mod:`flowrl.quant.fp8_torchao`): per-row scales of
  weights and of every input at each call (no calibration), the same layers quantized; CUDA sm_89+ and a
  bf16 model only (torchao's float8 refuses the CPU). Made for a compiled exploration copy
  (``model.compile``), where the input quantization fuses into the preceding kernel.

Without a CUDA GPU, plain ``fp8`` is unavailable and says what runs here instead
(``int8-dynamic``: real int8 kernels; ``nvfp4-emulated``: FP4 numerics).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from .calibration import record_input_amax
from .common import DEFAULT_SKIP, is_skipped, merged_copy, replace_linears
from .fp8_linear import FP8Linear, scaled_mm_problem
from .fp8_torchao import check_torchao_module, quantize_torchao, torchao_problem
from .kernels import SIMULATED, cuda_capability, describe_capability, tag_kernel
from .modelopt_support import ModeloptPreset, modelopt_problem

KERNELS = ("scaled_mm", "modelopt", "torchao")
WEIGHTS = ("auto", "per_channel", "per_tensor")
CPU_ALTERNATIVES = "on this machine use 'int8-dynamic' (real int8 kernels) or 'nvfp4-emulated' (FP4 numerics)"


FUSED_FROM = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
              "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def fuse_qkv_projections(module: nn.Module) -> None:
    """Fuse ``module``'s attention projections in place (diffusers' ``fuse_qkv_projections``: ``to_qkv``,
    ``to_added_qkv``) and drop the unfused ones the fused processors no longer call; or say which model
    lacks it."""
    fuse = getattr(module, "fuse_qkv_projections", None)
    if not callable(fuse):
        raise ValueError(f"fp8:fuse_qkv=true needs a transformer with diffusers' fuse_qkv_projections (SD3, FLUX); "
                         f"{type(module).__name__} has none: drop fuse_qkv")
    fuse()
    for m in module.modules():
        if not getattr(m, "fused_projections", False):
            continue
        unused = {part for fused, parts in FUSED_FROM.items() if isinstance(getattr(m, fused, None), nn.Module)
                  for part in parts}
        for part in unused:
            if isinstance(getattr(m, part, None), nn.Module):  # a None entry stays: processors test it
                delattr(m, part)


@dataclass
class FP8Quantizer(ModeloptPreset):
    """FP8-E4M3 exploration copy (module doc), calibrated once.

    Args:
        kernel: ``"scaled_mm"`` (real FP8 GEMMs on sm_89+), ``"modelopt"`` (fake quantization) or
            ``"torchao"`` (torchao's row-wise dynamic float8, sm_89+).
        weight: weight scales of ``scaled_mm``: ``"per_channel"``, ``"per_tensor"`` or ``"auto"``
            (per channel where this torch's ``_scaled_mm`` takes row-wise scales on the device,
            else per tensor); of ``torchao``: per row unless ``"per_tensor"``.
        fast_accum: ``_scaled_mm``'s fast accumulation (Hopper tensor cores; ignored on the CPU).
        fuse_qkv: fuse each attention's query/key/value projections first (diffusers'
            ``fuse_qkv_projections``): one FP8 GEMM and one input quantization where there were three
            of the same input (off by default: not yet measured on a GPU; ``docs/gpu_benchmark.md``).
        simulate_on_cpu: allow the CPU (numerics only, slower than fp32) when there is no CUDA GPU.
        skip: fnmatch patterns of module names kept in full precision.
    """

    kernel: str = "scaled_mm"
    weight: str = "auto"
    fast_accum: bool = True
    fuse_qkv: bool = False
    simulate_on_cpu: bool = False
    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "fp8"
    PRESET: ClassVar[str] = "FP8_DEFAULT_CFG"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel not in KERNELS:
            raise ValueError(f"fp8 kernel must be one of {KERNELS} ('scaled_mm': real FP8 GEMMs on sm_89+ GPUs; "
                             f"'modelopt': fake quantization; 'torchao': torchao's row-wise dynamic float8), "
                             f"got {self.kernel!r}")
        if self.weight not in WEIGHTS:
            raise ValueError(f"fp8 weight must be one of {WEIGHTS}, got {self.weight!r}")
        for flag in ("fast_accum", "fuse_qkv", "simulate_on_cpu"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"fp8 {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.kernel == "torchao" and self.simulate_on_cpu:
            raise ValueError("fp8:kernel=torchao has no CPU simulation (torchao's float8 refuses to run off CUDA); "
                             "drop simulate_on_cpu, or use fp8:simulate_on_cpu=true (kernel scaled_mm) for FP8 "
                             "numerics on a CPU")

    @property
    def needs_calibration(self) -> bool:
        """Static input scales (``scaled_mm``, ``modelopt``) are calibrated; torchao's are dynamic."""
        return self.kernel != "torchao"

    @property
    def syncs_in_place(self) -> bool:
        """A copy holds all its state in parameters and buffers, so a re-sync may copy a new one into it
        (:class:`~flowrl.quant.sync.QuantizedCopy`; modelopt's quantizers keep Python-side state)."""
        return self.kernel != "modelopt"

    # ------------------------------------------------------------------ availability
    def unavailable_reason(self) -> Optional[str]:
        if self.kernel == "torchao":
            return torchao_problem()
        if self.kernel == "modelopt":
            if not torch.cuda.is_available() and not self.simulate_on_cpu:
                return (f"fp8 (kernel=modelopt) needs a CUDA GPU (torch.cuda.is_available() is False); pass "
                        f"simulate_on_cpu=true to simulate it on the CPU (slower than fp32), or {CPU_ALTERNATIVES}")
            return modelopt_problem()
        if not torch.cuda.is_available():
            if not self.simulate_on_cpu:
                return (f"fp8 runs FP8 GEMMs on a CUDA GPU (sm_89+: Ada, Hopper, Blackwell) and "
                        f"torch.cuda.is_available() is False; {CPU_ALTERNATIVES}; 'fp8:simulate_on_cpu=true' runs "
                        f"fp8's numerics here through the CPU torch._scaled_mm (simulated, slower than fp32)")
            return scaled_mm_problem("cpu", "per_tensor")
        return self._device_problem(torch.device("cuda", torch.cuda.current_device()))

    def _device_problem(self, device: torch.device) -> Optional[str]:
        if device.type == "cuda":
            cap = cuda_capability(device)
            if cap is not None and cap < (8, 9):
                return (f"fp8 GEMMs need an sm_89+ GPU (Ada, Hopper, Blackwell); this one is "
                        f"{describe_capability(cap)} ({torch.cuda.get_device_name(device)}). Here "
                        f"'fp8:kernel=modelopt' "
                        f"simulates FP8 (slower than bf16) and 'nvfp4-emulated' FP4 numerics")
        elif not self.simulate_on_cpu:
            return (f"fp8's torch._scaled_mm kernels run on CUDA and the model is on {device}: move it to a GPU, or "
                    f"pass simulate_on_cpu=true (numerics only, slower than fp32); {CPU_ALTERNATIVES}")
        # "auto" needs only per-tensor scales to work (it falls back to them)
        return scaled_mm_problem(str(device), "per_channel" if self.weight == "per_channel" else "per_tensor")

    def resolved_weight(self, device: torch.device) -> str:
        """``weight`` with ``"auto"`` resolved for ``device``."""
        if self.weight != "auto":
            return self.weight
        return "per_channel" if scaled_mm_problem(str(device), "per_channel") is None else "per_tensor"

    # ------------------------------------------------------------------ quantize
    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]]) -> nn.Module:
        """A private FP8 copy of ``module``; ``calibrate(copy)`` runs real prompts through it once
        (in full precision) to set the static input scales."""
        if self.kernel == "modelopt":
            q = super().quantize(module, calibrate)
            return tag_kernel(q, real=False, kernel=f"{SIMULATED}: modelopt FP8 fake quantization "
                                                    f"(quantize-dequantize around full-precision matmuls)")
        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        if self.kernel == "torchao":
            return self._quantize_torchao(module)
        device = next(module.parameters()).device
        problem = self._device_problem(device)
        if problem:
            raise RuntimeError(problem)
        if calibrate is None:
            raise ValueError("fp8 calibrates its activation scales once: pass calibrate, a callable that runs real "
                             "prompts through the module")
        q = merged_copy(module)
        if self.fuse_qkv:
            fuse_qkv_projections(q)
        names = [n for n, m in q.named_modules() if isinstance(m, nn.Linear) and not is_skipped(n, self.skip)]
        if not names:
            raise ValueError(f"fp8 found no nn.Linear outside the skip-list {self.skip}; nothing to quantize")
        amax = record_input_amax(q, names, calibrate, "fp8")
        weight = self.resolved_weight(device)
        replace_linears(q, lambda n, lin: FP8Linear(lin, amax[n], weight, self.fast_accum), self.skip)
        if device.type == "cuda":
            return tag_kernel(q, real=True, kernel=f"torch._scaled_mm FP8-E4M3 GEMMs ({weight} weight scales, "
                                                   f"static input scales{', fused q/k/v' if self.fuse_qkv else ''})")
        return tag_kernel(q, real=False, kernel=f"{SIMULATED}: torch._scaled_mm FP8 numerics on {device.type} "
                                                f"(reference implementation, no FP8 units)")

    def _quantize_torchao(self, module: nn.Module) -> nn.Module:
        """torchao's row-wise dynamic float8 on a private merged copy (LoRA merged first)."""
        check_torchao_module(module, self.weight)
        q = merged_copy(module)
        if self.fuse_qkv:
            fuse_qkv_projections(q)
        done, left = quantize_torchao(q, self.skip, self.weight, self.fast_accum)
        scales = "per-tensor" if self.weight == "per_tensor" else "row-wise"
        return tag_kernel(q, real=True, kernel=f"torchao float8 dynamic ({scales} weight and input scales, {done} "
                                               f"linear layers; {left} left in full precision for their shape"
                                               f"{', fused q/k/v' if self.fuse_qkv else ''})")
