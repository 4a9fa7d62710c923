"""An ``nn.Linear`` whose matmul runs in FP8-E4M3 through ``torch._scaled_mm``.

Numerics (E4M3: largest finite value 448, round to nearest even, no infinities):

* weight, quantized once: ``s_w = amax(|W|) / 448`` per output channel (``"per_channel"``,
  ``_scaled_mm``'s row-wise scales) or per tensor; ``W_q = e4m3(clamp(W / s_w, +-448))``.
* input, static scale calibrated once on real prompts: ``s_x = amax_calibrated / 448``;
  ``x_q = e4m3(clamp(x / s_x, +-448))`` (the division runs in the input's dtype: bf16 on a GPU),
  values beyond the calibrated range saturate.
* ``y = (x_q @ W_q^T) * s_x * s_w + b`` with fp32 accumulation; bf16 out on CUDA, the input's
  dtype on the CPU.

Layout (what ``_scaled_mm`` needs on CUDA): ``x_q`` row-major ``[M, K]``, the weight passed as
``W_q.t()`` (column-major ``[K, N]``), K and N multiples of 16: odd sizes are zero-padded
(padded weight rows/columns are 0, so the result is unchanged) and the output sliced back.
Row-wise scales need both operands row-wise, so per-channel weights take the static input
scale as an ``[M, 1]`` column (cached per M).

On sm_89+ GPUs these are real FP8 tensor-core GEMMs; on a CPU ``_scaled_mm`` is a reference
implementation (upcast and fp32 matmul): the same numerics, no speed-up.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16
WEIGHT_SCALINGS = ("per_channel", "per_tensor")


def e4m3_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / scale, +-448))`` with ``scale`` a 0-dim fp32 tensor or broadcastable."""
    return (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _pad_to(n: int, multiple: int = ALIGN) -> int:
    return (-n) % multiple


@functools.lru_cache(maxsize=None)
def scaled_mm_problem(device: str, weight: str) -> Optional[str]:
    """None if ``torch._scaled_mm`` with ``weight`` scaling runs on ``device`` ('cpu', 'cuda:0'), else why not."""
    try:
        dev = torch.device(device)
        a = torch.ones(16, 32, device=dev).to(E4M3)  # [M, K]
        b = torch.ones(16, 32, device=dev).to(E4M3)  # [N, K]
        one = torch.ones((), device=dev)
        sa, sb = (one, one) if weight == "per_tensor" else \
            (torch.ones(16, 1, device=dev), torch.ones(1, 16, device=dev))  # [M, 1], [1, N]
        out = torch.bfloat16 if dev.type == "cuda" else torch.float32
        y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out)  # [16, 16]
        if not bool((y.float() == 32.0).all()):
            return f"torch._scaled_mm returned wrong values on {device} (expected 32)"
    except Exception as e:  # noqa: BLE001 - any failure means the kernel is unusable here
        return f"torch {torch.__version__} has no working {weight} FP8 torch._scaled_mm on {device}: " \
               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class FP8Linear(nn.Module):
    """``y = x W^T + b`` with W and x in FP8-E4M3 (module doc), static input scale.

    Args:
        linear: the full-precision layer (its weight is quantized once, not kept).
        input_amax: calibrated absolute maximum of the layer's input (0: the layer outputs about
            its bias).
        weight: ``"per_channel"`` (one scale per output feature) or ``"per_tensor"``.
        fast_accum: ``_scaled_mm``'s ``use_fast_accum`` (Hopper: faster, slightly less exact
            accumulation; ignored on the CPU).
    """

    def __init__(self, linear: nn.Linear, input_amax: float, weight: str = "per_channel", fast_accum: bool = True):
        super().__init__()
        if weight not in WEIGHT_SCALINGS:
            raise ValueError(f"FP8Linear weight must be one of {WEIGHT_SCALINGS}, got {weight!r}")
        w = linear.weight.detach()  # [N, K]
        dev = w.device
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])
        self.pad_k, self.pad_n = _pad_to(self.in_features), _pad_to(self.out_features)
        self.weight_scaling, self.fast_accum = weight, bool(fast_accum)
        wf = F.pad(w.float(), (0, self.pad_k, 0, self.pad_n))  # [Np, Kp] fp32, zero padding
        if weight == "per_channel":
            s_w = (wf.abs().amax(dim=1) / E4M3_MAX).clamp_min(1e-12)  # [Np]
            qw = e4m3_quantize(wf, s_w[:, None])  # [Np, Kp]
            s_w = s_w[None, :].contiguous()  # [1, Np]: _scaled_mm's row-wise scale_b
        else:
            s_w = (wf.abs().amax() / E4M3_MAX).clamp_min(1e-12)  # []
            qw = e4m3_quantize(wf, s_w)
        del wf
        self.register_buffer("qweight", qw.contiguous())  # [Np, Kp] float8, row-major: .t() is column-major
        self.register_buffer("weight_scale", s_w.float())  # [1, Np] or []
        # an all-zero calibration gets a vanishing scale: any later input saturates at ~1e-12 / 448 (about 0)
        s_x = max(float(input_amax), 1e-12) / E4M3_MAX
        self.register_buffer("input_scale", torch.tensor(s_x, dtype=torch.float32, device=dev))  # []
        b = None if linear.bias is None else F.pad(linear.bias.detach(), (0, self.pad_n)).clone()  # [Np]
        self.register_buffer("bias", b)
        self._row_scales: dict[tuple[int, torch.device, int], torch.Tensor] = {}

    def _scale_a(self, m: int) -> torch.Tensor:
        """The input's scale as ``_scaled_mm`` wants it: 0-dim (per-tensor) or ``[M, 1]`` contiguous."""
        if self.weight_scaling == "per_tensor":
            return self.input_scale
        if torch.compiler.is_compiling():  # no Python-side cache inside a compiled graph
            return self.input_scale.reshape(1, 1).repeat(m, 1)  # [M, 1]
        key = (m, self.input_scale.device, self.input_scale._version)  # a re-sync in place bumps the version
        col = self._row_scales.get(key)
        if col is None:
            if len(self._row_scales) > 16:  # a few batch sizes recur; do not grow without bound
                self._row_scales.clear()
            col = self._row_scales[key] = self.input_scale.reshape(1, 1).repeat(m, 1)  # [M, 1], strides (1, 1)
        return col

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.pad_k:
            x2 = F.pad(x2, (0, self.pad_k))  # [M, Kp]
        xq = e4m3_quantize(x2, self.input_scale)  # [M, Kp] float8, row-major
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        bias = None if self.bias is None else self.bias.to(out_dtype)
        y = torch._scaled_mm(xq, self.qweight.t(), scale_a=self._scale_a(xq.shape[0]), scale_b=self.weight_scale,
                             bias=bias, out_dtype=out_dtype, use_fast_accum=self.fast_accum)  # [M, Np]
        if self.pad_n:
            y = y[:, : self.out_features]  # [M, N]
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight_scaling}, "
                f"input_scale={float(self.input_scale):.3e}, fast_accum={self.fast_accum}")
