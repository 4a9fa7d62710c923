"""NVFP4 numerics in pure torch: E2M1 values, blocks of 16, FP8-E4M3 block scales, fp32 global scale.

The format (NVIDIA Blackwell NVFP4; the numerics of modelopt's ``NVFP4QTensor``, which
Sol-RL, arXiv 2604.06916, explores with through Transformer Engine on B200):

* global scale (fp32, one per tensor): ``s_g = amax / (6 * 448)``; 6 = largest E2M1 value,
  448 = largest FP8-E4M3 value. For activations ``amax`` is **calibrated once** (static):
  taking it over the current batch would make a sample depend on its batch-mates.
* block scale (FP8-E4M3, one per 16 consecutive elements of the last dim):
  ``s_b = e4m3(block_amax / (6 * s_g))``, clamped to ``[2**-9, 448]`` before the cast (an
  all-zero block gets ``s_b = 1``); E4M3 rounding is round-to-nearest-even (torch's cast).
* element: ``q = e2m1(x / (s_b * s_g))``, E2M1 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign,
  round-half-to-even, saturating at +-6; the fake-quantized value is ``q * s_b * s_g``.

Everything is computed in float32 and cast back to the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0 ** -9          # smallest positive (subnormal) FP8-E4M3 value
BLOCK_SIZE = 16



def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round float32 ``y`` (any shape) to the nearest E2M1 value, ties to even, saturating at +-6.

    The E2M1 grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]; ``torch.round`` rounds
    half to even, which on each segment is the even-mantissa tie rule (0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    """
    a = y.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    q = (torch.round(a / step) * step).clamp_(max=E2M1_MAX)
    return torch.copysign(q, y)


def e4m3_round(s: torch.Tensor) -> torch.Tensor:
    """Clamp positive float32 scales to ``[2**-9, 448]`` and round them to FP8-E4M3 (nearest even)."""
    return s.clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """fp32 per-tensor scale ``amax / (6 * 448)`` (0-dim tensor)."""
    return torch.as_tensor(amax, dtype=torch.float32).reshape(()) / (E2M1_MAX * E4M3_MAX)


def nvfp4_fake_quant(x: torch.Tensor, amax: torch.Tensor | float, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Quantize ``x`` [..., D] to NVFP4 and back, blocks of ``block_size`` along the last dim.

    ``amax`` is the per-tensor absolute maximum that sets the fp32 global scale: the tensor's
    own for weights, a calibrated (static) one for activations. Values beyond it saturate.
    A last dim that is not a multiple of the block is zero-padded (as modelopt does).
    """
    if x.ndim == 0:
        raise ValueError("nvfp4_fake_quant needs a tensor with at least one dimension")
    dtype, d = x.dtype, x.shape[-1]
    xf = x.float()
    pad = (-d) % block_size
    if pad:
        xf = F.pad(xf, (0, pad))
    blocks = xf.reshape(*xf.shape[:-1], -1, block_size)  # [..., D / 16, 16]
    s_g = global_scale(amax).to(xf.device)  # []
    live = s_g > 0  # an all-zero calibration (amax 0) represents nothing but 0
    s_g = torch.where(live, s_g, torch.ones_like(s_g))
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., D / 16, 1]
    s_b = block_amax / (E2M1_MAX * s_g)
    s_b = e4m3_round(torch.where(s_b == 0, torch.ones_like(s_b), s_b))  # [..., D / 16, 1]
    scale = s_b * s_g  # [..., D / 16, 1]
    q = e2m1_round(blocks / scale) * scale * live  # [..., D / 16, 16]
    q = q.reshape(*xf.shape)[..., :d]
    return q.to(dtype)
