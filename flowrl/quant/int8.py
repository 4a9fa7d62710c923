"""``int8-dynamic``: int8 weights and int8 activations on the CPU (fbgemm).

Weights are int8 per output channel (symmetric, step ``amax_j / 127``), packed once for
fbgemm; the matmuls run as uint8 x int8 with exact int32 accumulation and a fused float
epilogue (zero-point correction, scales, bias) inside fbgemm, the real CPU speed-up of Sol-RL's
exploration pass on this machine.

Activation modes (all quantize to 7 bits, codes ``64 +- 63``, because fbgemm's AVX2 kernel
sums pairs of uint8 x int8 products in int16 and would saturate on 8-bit codes; torch.ao's
``reduce_range=True`` is the same constraint):

- ``"per_row"`` (default): each row (token) gets its own scale ``amax_i / 63``, so a sample's
  output never depends on its batch-mates, bit for bit. The row maxima take two cheap
  reductions; the rows are scaled to [-1, 1] by one multiply, quantized with the fixed scale
  1/63 inside the GEMM's packing (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``:
  no tensor-wide min/max pass, nothing concatenated) and the output rows are multiplied back
  (fused with the bias, one pass).
- ``"static"``: one per-tensor scale ``amax / 63`` calibrated once on real prompts (inputs
  clamped to the calibrated range): batch-independent too, one clamp pass and the GEMM, bias
  inside the kernel; no per-token adaptivity, and the calibration runs at every sync.
- ``"per_tensor"``: torch.ao's behaviour (``torch.ops.quantized.linear_dynamic``, scale from
  the whole input's min/max): a sample depends on its batch-mates; kept to measure that.

What else keeps it at the kernel's speed (measured on ``sd3-mid``, 2 cores, issue 15):

- the element-wise passes (row maxima, scaling, rescale, clamp) run on the calling thread
  only (:class:`_OneThread`): as two-thread parallel regions they were cheap on an idle machine
  but each waited a scheduler time slice for a descheduled worker on a busy one, which is how
  ``per_row`` fell to 1.0x there while torch.ao (one region per layer, the GEMM) kept 1.3x;
- the prepared input goes into a per-copy workspace kept between calls instead of a fresh
  multi-megabyte tensor per layer (page faults and zeroed pages after every heap trim);
- layers fed the very same input tensor (an attention's q, k and v projections) share its
  preparation: a memo of the last prepared input keyed on the tensor's identity and in-place
  version counter, so a changed or different input is never mistaken for it.

Where the fused kernel is missing (another quantized engine, an old torch), ``per_row`` and
``static`` fall back to ``linear_dynamic`` with two sentinel rows (+-1 or +-amax) that pin its
tensor-wide range: same batch independence, a few more passes.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from .common import DEFAULT_SKIP, merged_copy, replace_linears
from .int8_kernels import (KERNELS, LEVELS, PARALLEL_PASS_NUMEL, SharedInput, _kernel_problem, _OneThread,
                           _onednn_linear, _qdq_linear, _uint8_codes, resolve_kernel)

__all__ = ["ACTIVATION_MODES", "WEIGHT_MODES", "DynamicInt8Linear", "Int8DynamicQuantizer"]

ACTIVATION_MODES = ("per_row", "static", "per_tensor")
WEIGHT_MODES = ("per_channel", "per_tensor")
_TINY = 1e-30  # floor of a row / calibrated maximum: all-zero rows stay exactly 0


class DynamicInt8Linear(nn.Module):
    """``y = x W^T + b`` with W int8 (per output channel) and x quantized to int8 on the fly.

    Holds the packed int8 weight (oneDNN or fbgemm); ``bias`` stays float32. Inputs
    ``[..., in_features]`` of any float dtype; the result has the input's dtype. With
    ``activation="static"`` the layer starts in calibration mode (full-precision passes recording
    the input's absolute maximum) until :meth:`finish_calibration`. ``shared``: the copy's
    :class:`SharedInput` (None: a private one). ``kernel``: one of :data:`KERNELS` or ``"auto"``
    (``per_tensor`` always runs ``linear_dynamic``).
    """

    def __init__(self, linear: nn.Linear, activation: str = "per_row", weight: str = "per_channel",
                 shared: Optional[SharedInput] = None, kernel: str = "auto"):
        super().__init__()
        if activation not in ACTIVATION_MODES:
            raise ValueError(f"activation must be one of {ACTIVATION_MODES}, got {activation!r}")
        if weight not in WEIGHT_MODES:
            raise ValueError(f"weight must be one of {WEIGHT_MODES}, got {weight!r}")
        w = linear.weight.detach().float().cpu()  # [O, I]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.activation = activation
        self.kernel = "linear_dynamic" if activation == "per_tensor" else resolve_kernel(kernel)
        self.shared = shared if shared is not None else SharedInput()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's quantized-tensor deprecation notices
            if weight == "per_channel":
                scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # [O]
                qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            else:
                scale = torch.full((self.out_features,), max(float(w.abs().max()) / 127.0, 1e-12), dtype=torch.float64)
                qw = torch.quantize_per_tensor(w, float(scale[0]), 0, torch.qint8)
            bias = None if linear.bias is None else linear.bias.detach().float().cpu().clone()  # [O]
            # the kernel adds the bias, except per_row: added with the row rescale (one pass)
            kernel_bias = None if activation == "per_row" else bias
            if self.kernel == "onednn":
                self._w_codes = qw.int_repr()  # [O, I] int8: oneDNN's packed copy is opaque (no copy, no pickle)
                self._packed = torch.ops.onednn.qlinear_prepack(self._w_codes, None)
                self._w_scale, self._w_zp = scale.float(), torch.zeros(self.out_features, dtype=torch.long)  # [O]
                self._kernel_bias = kernel_bias
            else:
                self._packed = torch.ops.quantized.linear_prepack(qw, kernel_bias)
        self.register_buffer("bias", bias if activation == "per_row" else None)
        self.calibrating = activation == "static"
        self._float = (w, bias) if self.calibrating else None  # full-precision weights while calibrating
        self.register_buffer("input_amax", torch.tensor(float("nan")))  # static: calibrated |x| maximum
        self._amax = 1.0  # static: the frozen range
        n_scales = self.out_features if weight == "per_channel" else 1
        self._weight_bytes = qw.numel() + 8 * n_scales  # int8 weights + fp64 scales

    def extra_bytes(self) -> int:
        """Bytes of the packed int8 weight (not a parameter, so counted here)."""
        return self._weight_bytes

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self.kernel == "onednn":
            state.pop("_packed")  # an opaque oneDNN tensor: packed again from the int8 codes
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if self.kernel == "onednn":
            self._packed = torch.ops.onednn.qlinear_prepack(self._w_codes, None)

    @torch.no_grad()
    def finish_calibration(self) -> None:
        """Freeze the calibrated input range (static mode)."""
        a = float(self.input_amax)
        if math.isnan(a):
            raise RuntimeError("this int8 layer saw no calibration data: the calibrate callable must run real "
                               "prompts through every quantized layer")
        self._amax = max(a, _TINY)
        self.calibrating, self._float = False, None

    # ------------------------------------------------------------------ forward paths
    def _gemm(self, prepared: torch.Tensor, scale: float) -> torch.Tensor:
        """The int8 GEMM on a prepared input (uint8 codes for oneDNN, floats for fbgemm) [N, O]."""
        if self.kernel == "onednn":
            return _onednn_linear(prepared, scale, self._packed, self._w_scale, self._w_zp, self._kernel_bias)
        return _qdq_linear(prepared, scale, self._packed)

    def _per_row(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        prep = self.shared.get(x, "row")
        if prep is None:
            xn = self.shared.workspace(*x2.shape)  # [N, I]
            with _OneThread(parallel=x2.numel() >= PARALLEL_PASS_NUMEL):
                # row absolute maximum as max(max, -min): two fast reductions, no |x| copy
                a = torch.maximum(x2.amax(dim=1, keepdim=True), x2.amin(dim=1, keepdim=True).neg_())  # [N, 1]
                a = a.clamp_min_(_TINY)
                torch.mul(x2, a.reciprocal(), out=xn)  # rows in [-1, 1] (+ rounding: codes still in [1, 127])
                if self.kernel == "onednn":
                    xn = _uint8_codes(xn, 1.0 / LEVELS)  # [N, I]
            prep = (xn, a)
            self.shared.put(x, "row", prep)
        xn, a = prep
        y = self._gemm(xn, 1.0 / LEVELS)  # [N, O], rows still divided by a
        with _OneThread(parallel=y.numel() >= PARALLEL_PASS_NUMEL):
            return torch.addcmul(self.bias, y, a, out=y) if self.bias is not None else y.mul_(a)

    def _static(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        key = ("clamp", self._amax)
        prep = self.shared.get(x, key)
        if prep is None:
            xc = self.shared.workspace(*x2.shape)  # [N, I]
            with _OneThread(parallel=x2.numel() >= PARALLEL_PASS_NUMEL):
                xc = torch.clamp(x2, -self._amax, self._amax, out=xc)  # codes stay in [1, 127]
                if self.kernel == "onednn":
                    xc = _uint8_codes(xc, self._amax / LEVELS)
            prep = (xc,)
            self.shared.put(x, key, prep)
        return self._gemm(prep[0], self._amax / LEVELS)  # [N, O], bias included

    def _sentinel(self, x2: torch.Tensor) -> torch.Tensor:
        """Fallback without a fixed-scale kernel: two rows at +-r pin linear_dynamic's tensor-wide range."""
        n = x2.shape[0]
        xn = torch.empty(n + 2, self.in_features, dtype=torch.float32)  # [N + 2, I]
        if self.activation == "static":
            torch.clamp(x2, -self._amax, self._amax, out=xn[:n])
            xn[n], xn[n + 1] = self._amax, -self._amax
            return torch.ops.quantized.linear_dynamic(xn, self._packed, True)[:n]  # bias included
        a = torch.maximum(x2.amax(dim=1, keepdim=True), x2.amin(dim=1, keepdim=True).neg_()).clamp_min_(_TINY)
        torch.div(x2, a, out=xn[:n])  # rows in [-1, 1] exactly (correctly rounded division)
        xn[n], xn[n + 1] = 1.0, -1.0
        y = torch.ops.quantized.linear_dynamic(xn, self._packed, True)[:n]
        return torch.addcmul(self.bias, y, a, out=y) if self.bias is not None else y.mul_(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x2 = x.detach().reshape(-1, self.in_features)  # [N, I], a view when x is contiguous (no autograd here)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
            x = x2  # a fresh tensor: never matches another layer's memo
        if self.calibrating:
            self.input_amax = torch.fmax(self.input_amax, x2.abs().amax())
            y = torch.nn.functional.linear(x2, *self._float)  # [N, O]
        elif x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        elif self.kernel == "linear_dynamic":
            y = torch.ops.quantized.linear_dynamic(x2, self._packed, True)  # [N, O], bias included
        elif self.kernel == "sentinel":
            y = self._sentinel(x2)
        elif self.activation == "per_row":
            y = self._per_row(x, x2)
        else:
            y = self._static(x, x2)
        return y.reshape(*shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}, "
                f"kernel={self.kernel}")


@dataclass
class Int8DynamicQuantizer:
    """Dynamic int8 of every ``nn.Linear`` outside ``skip`` (CPU only).

    Args:
        activation: ``"per_row"`` (batch-independent, default, no calibration), ``"static"``
            (batch-independent, calibrated per-tensor range) or ``"per_tensor"`` (torch.ao's
            scale over the whole input: a sample depends on its batch-mates).
        weight: ``"per_channel"`` (one scale per output feature) or ``"per_tensor"``.
        skip: fnmatch patterns of module names kept in full precision.
        kernel: GEMM of ``per_row`` / ``static``: ``"auto"`` (the fastest that works here),
            ``"onednn"``, ``"fbgemm"`` or ``"sentinel"`` (see :data:`KERNELS`).
    """

    activation: str = "per_row"
    weight: str = "per_channel"
    skip: tuple[str, ...] = DEFAULT_SKIP
    kernel: str = "auto"
    name: ClassVar[str] = "int8-dynamic"
    # model.compile leaves the copy eager: dynamo cannot trace fbgemm's packed weights (no meta kernels) nor the
    # per-layer thread switching, so a compiled copy would be graph breaks around every layer
    compilable: ClassVar[bool] = False

    @property
    def needs_calibration(self) -> bool:
        """Only ``activation="static"`` calibrates (its input ranges)."""
        return self.activation == "static"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATION_MODES:
            raise ValueError(f"int8-dynamic activation must be one of {ACTIVATION_MODES}, got {self.activation!r}")
        if self.weight not in WEIGHT_MODES:
            raise ValueError(f"int8-dynamic weight must be one of {WEIGHT_MODES}, got {self.weight!r}")
        if self.kernel != "auto" and self.kernel not in KERNELS:
            raise ValueError(f"int8-dynamic kernel must be 'auto' or one of {KERNELS}, got {self.kernel!r}")
        self.skip = tuple(self.skip)

    def unavailable_reason(self) -> Optional[str]:
        return _kernel_problem()

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
        """A private int8 copy of ``module``; ``calibrate(copy)`` runs real prompts through it in
        ``"static"`` mode (ignored otherwise)."""
        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        dev = next(module.parameters()).device
        if dev.type != "cpu":
            raise ValueError(f"int8-dynamic runs on the CPU only (oneDNN / fbgemm kernels) but the model is on {dev}; "
                             f"on a GPU use 'fp8' or 'nvfp4'")
        kernel = "linear_dynamic" if self.activation == "per_tensor" else resolve_kernel(self.kernel)
        q = merged_copy(module)
        shared = SharedInput()  # one per copy: scratch memory, and layers fed the same tensor prepare it once
        done = replace_linears(q, lambda n, lin: DynamicInt8Linear(lin, self.activation, self.weight, shared,
                                                                   "auto" if kernel == "linear_dynamic" else kernel),
                               self.skip)
        if not done:
            raise ValueError(f"int8-dynamic found no nn.Linear outside the skip-list {self.skip}; nothing to quantize")
        if self.needs_calibration:
            if calibrate is None:
                raise ValueError("int8-dynamic activation='static' calibrates its input ranges once: pass calibrate, "
                                 "a callable that runs real prompts through the module")
            with torch.no_grad():
                calibrate(q)
            for m in q.modules():
                if isinstance(m, DynamicInt8Linear):
                    m.finish_calibration()
        shared.release()  # calibration's scratch; sampling allocates it once and keeps it
        try:
            from .kernels import tag_kernel
        except ImportError:  # pragma: no cover - older tree without the kernel tags
            return q
        gemm = {"onednn": "oneDNN", "fbgemm": "fbgemm", "sentinel": "fbgemm", "linear_dynamic": "fbgemm"}[kernel]
        return tag_kernel(q, real=True, kernel=f"{gemm} int8 GEMMs (CPU), {self.activation} activations")
