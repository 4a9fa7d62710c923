"""``int8-dynamic``: int8 weights and dynamically quantized int8 activations on the CPU (fbgemm).

The kernel is torch.ao's dynamic quantized Linear (``torch.ops.quantized.linear_dynamic``,
what ``torch.ao.quantization.quantize_dynamic`` installs): int8 x int8 matmuls with int32
accumulation, the real CPU speed-up of Sol-RL's exploration pass on this machine.

torch.ao takes the activation scale over the **whole input tensor**, so a sample's output
depends on its batch-mates. The default ``activation="per_row"`` removes that: each row
(token) is divided by its own absolute maximum before the call and multiplied back after,
and two sentinel rows (+1, -1) pin the kernel's tensor-wide range to [-1, 1]; row i is then
quantized with step ``2 * amax_i / 127`` whatever else is in the batch, and with exact int32
accumulation its output row does not depend on the other rows, bit for bit. The extra
passes (row maxima, division, rescale) cost some of the int8 speed-up, most on narrow layers.
``activation="static"`` pins the range instead to a per-tensor absolute maximum calibrated
once on real prompts (inputs clamped to it, sentinel rows at +-amax): batch-independent too,
one input pass instead of three and no output pass, but no per-token adaptivity.
``activation="per_tensor"`` is torch.ao's behaviour, kept to measure that batch sensitivity.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from .common import DEFAULT_SKIP, merged_copy, replace_linears

ACTIVATION_MODES = ("per_row", "static", "per_tensor")
WEIGHT_MODES = ("per_channel", "per_tensor")


@functools.lru_cache(maxsize=None)
def _kernel_problem() -> Optional[str]:
    """None if fbgemm's dynamic int8 Linear runs here, else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_tensor(torch.ones(4, 4), 1.0 / 127, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qw, None)
            torch.ops.quantized.linear_dynamic(torch.ones(2, 4), packed, True)
    except Exception as e:  # noqa: BLE001 - any failure means the kernel is unusable here
        return (f"torch {torch.__version__} has no working dynamic int8 Linear kernel "
                f"(torch.ops.quantized.linear_dynamic: {type(e).__name__}: {e})")
    return None


class DynamicInt8Linear(nn.Module):
    """``y = x W^T + b`` with W int8 (per output channel) and x quantized to int8 on the fly.

    Holds the fbgemm-packed weight; ``bias`` stays float32. Inputs ``[..., in_features]`` of
    any float dtype; the result has the input's dtype. With ``activation="static"`` the layer
    starts in calibration mode (full-precision passes recording the input's absolute maximum)
    until :meth:`finish_calibration`.
    """

    def __init__(self, linear: nn.Linear, activation: str = "per_row", weight: str = "per_channel"):
        super().__init__()
        w = linear.weight.detach().float().cpu()  # [O, I]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.activation = activation
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's quantized-tensor deprecation notices
            if weight == "per_channel":
                scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()  # [O]
                qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            else:
                qw = torch.quantize_per_tensor(w, max(float(w.abs().max()) / 127.0, 1e-12), 0, torch.qint8)
            bias = None if linear.bias is None else linear.bias.detach().float().cpu().clone()  # [O]
            # the kernel adds the bias (as torch.ao does), except per_row: added after the row rescale
            self._packed = torch.ops.quantized.linear_prepack(qw, None if activation == "per_row" else bias)
        self.register_buffer("bias", bias if activation == "per_row" else None)
        self.register_buffer("_sentinel", torch.tensor([[1.0], [-1.0]]).expand(2, self.in_features).contiguous(),
                             persistent=False)  # [2, I]
        self.calibrating = activation == "static"
        self._float = (w, bias) if self.calibrating else None  # full-precision weights while calibrating
        self.register_buffer("input_amax", torch.tensor(float("nan")))  # static: calibrated |x| maximum
        n_scales = self.out_features if weight == "per_channel" else 1
        self._weight_bytes = qw.numel() + 8 * n_scales  # int8 weights + fp64 scales

    def extra_bytes(self) -> int:
        """Bytes of the packed int8 weight (not a parameter, so counted here)."""
        return self._weight_bytes

    @torch.no_grad()
    def finish_calibration(self) -> None:
        """Freeze the calibrated input range (static mode)."""
        a = float(self.input_amax)
        if math.isnan(a):
            raise RuntimeError("this int8 layer saw no calibration data: the calibrate callable must run real "
                               "prompts through every quantized layer")
        self._sentinel = self._sentinel * max(a, 1e-30)  # rows at +-amax pin the kernel's range
        self._amax = max(a, 1e-30)
        self.calibrating, self._float = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()  # [N, I]
        n = x2.shape[0]
        if self.calibrating:
            self.input_amax = torch.fmax(self.input_amax, x2.detach().abs().amax())
            y = torch.nn.functional.linear(x2, *self._float)  # [N, O]
        elif self.activation == "static":
            xn = torch.empty(n + 2, self.in_features, dtype=torch.float32, device=x2.device)  # [N + 2, I]
            torch.clamp(x2, -self._amax, self._amax, out=xn[:n])
            xn[n:] = self._sentinel
            y = torch.ops.quantized.linear_dynamic(xn, self._packed, True)[:n]  # [N, O], bias included
        elif self.activation == "per_row":
            # row absolute maximum as max(max, -min): two reductions, no |x| copy
            a = torch.maximum(x2.amax(dim=1, keepdim=True), x2.amin(dim=1, keepdim=True).neg_())  # [N, 1]
            a = a.clamp_min_(1e-30)  # all-zero rows stay 0
            xn = torch.empty(n + 2, self.in_features, dtype=torch.float32, device=x2.device)  # [N + 2, I]
            torch.div(x2, a, out=xn[:n])  # rows in [-1, 1] exactly (|x| <= a, correctly rounded division)
            xn[n:] = self._sentinel
            y = torch.ops.quantized.linear_dynamic(xn, self._packed, True)[:n]  # [N, O]
            y = torch.addcmul(self.bias, y, a, out=y) if self.bias is not None else y.mul_(a)  # one pass
        else:
            y = torch.ops.quantized.linear_dynamic(x2, self._packed, True)  # [N, O], bias included
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation}"


@dataclass
class Int8DynamicQuantizer:
    """Dynamic int8 of every ``nn.Linear`` outside ``skip`` (CPU only).

    Args:
        activation: ``"per_row"`` (batch-independent, default, no calibration), ``"static"``
            (batch-independent, calibrated per-tensor range, faster) or ``"per_tensor"``
            (torch.ao's scale over the whole input: a sample depends on its batch-mates).
        weight: ``"per_channel"`` (one scale per output feature) or ``"per_tensor"``.
        skip: fnmatch patterns of module names kept in full precision.
    """

    activation: str = "per_row"
    weight: str = "per_channel"
    skip: tuple[str, ...] = DEFAULT_SKIP
    name: ClassVar[str] = "int8-dynamic"

    @property
    def needs_calibration(self) -> bool:
        """Only ``activation="static"`` calibrates (its input ranges)."""
        return self.activation == "static"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATION_MODES:
            raise ValueError(f"int8-dynamic activation must be one of {ACTIVATION_MODES}, got {self.activation!r}")
        if self.weight not in WEIGHT_MODES:
            raise ValueError(f"int8-dynamic weight must be one of {WEIGHT_MODES}, got {self.weight!r}")
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
            raise ValueError(f"int8-dynamic runs on the CPU only (fbgemm kernels) but the model is on {dev}; "
                             f"on a GPU use 'fp8' or 'nvfp4'")
        q = merged_copy(module)
        done = replace_linears(q, lambda n, lin: DynamicInt8Linear(lin, self.activation, self.weight), self.skip)
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
        return q
