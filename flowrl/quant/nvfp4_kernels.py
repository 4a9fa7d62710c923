"""Real NVFP4 GEMMs (Blackwell, sm_100+): ``torch.nn.functional.scaled_mm`` on ``float4_e2m1fn_x2``.

The numerics are those of :mod:`flowrl.quant.nvfp4_numerics` (E2M1 values, blocks of 16 along
K, FP8-E4M3 block scales, fp32 global scale ``amax / (6 * 448)``); this module lays them out
as the hardware wants them:

* values: E2M1 codes (sign bit 3, magnitude index 0..7 of {0, .5, 1, 1.5, 2, 3, 4, 6}), two
  per byte, element ``2j`` in the low nibble (``torch.float4_e2m1fn_x2``), ``[rows, K / 2]``;
* block scales: ``[rows, K / 16]`` E4M3, rearranged into cuBLAS's 128 x 4 tiles with their
  32 x 4 x 4 inner layout (``SwizzleType.SWIZZLE_32_4_4``; rows padded to 128, columns to 4);
* global scales: fp32 0-dim, ``scale_recipe = [BlockWise1x16, TensorWise]``.

Weights are packed once; inputs are quantized at every call with their calibrated (static)
global scale in plain torch (several elementwise passes: the FP4 GEMM is real, the input
quantization is not fused). Only CUDA sm_100+ runs it (the CPU ``scaled_mm`` has no swizzled
FP4 path); :func:`nvfp4_gemm_problem` checks a small GEMM against the emulated numerics first.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .nvfp4_numerics import BLOCK_SIZE, E2M1_MAX, e2m1_round, e4m3_round, global_scale, nvfp4_fake_quant

K_ALIGN = 64  # 4 block scales per swizzle tile column: K padded to 4 * 16


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 of float32 values already on the E2M1 grid (``e2m1_round`` output)."""
    a = q.abs()
    mag = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a / 2.0 + 4.0))  # 0..7
    return (mag.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E2M1 codes (inverse of :func:`e2m1_codes`)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=codes.device)
    v = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -v, v)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` uint8 codes -> ``[..., n]`` bytes, element ``2j`` in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_pairs`: ``[..., n]`` bytes -> ``[..., 2n]`` codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` block scales -> cuBLAS's blocked layout, flat (rows padded to 128, columns to 4).

    Tile ``(i // 128, j // 4)`` holds 512 bytes; inside it, scale ``(i, j)`` sits at
    ``(i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4`` (cuBLAS "1D block scaling factors layout").
    """
    r, c = scales.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    padded = scales.new_zeros(rp, cp) if (rp, cp) != (r, c) else scales
    if padded is not scales:
        padded[:r, :c] = scales
    tiles = padded.reshape(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3)  # [R/128, C/4, 128, 4]
    inner = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)  # [tiles, 32, 4 (row // 32), 4 (col)]
    return inner.reshape(-1).contiguous()


def nvfp4_pack(x: torch.Tensor, amax: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [R, K] (K a multiple of 16) -> (packed uint8 [R, K/2], block scales
    float8_e4m3fn [R, K/16], global scale fp32 []); ``nvfp4_unpack`` of them equals
    ``nvfp4_fake_quant(x, amax)``."""
    r, k = x.shape
    if k % BLOCK_SIZE:
        raise ValueError(f"nvfp4_pack needs K a multiple of {BLOCK_SIZE}, got {k}")
    blocks = x.float().reshape(r, k // BLOCK_SIZE, BLOCK_SIZE)  # [R, K/16, 16]
    s_g = global_scale(amax).to(x.device)  # []
    s_g = torch.where(s_g > 0, s_g, torch.ones_like(s_g))
    s_b = blocks.abs().amax(dim=-1, keepdim=True) / (E2M1_MAX * s_g)  # [R, K/16, 1]
    s_b = e4m3_round(torch.where(s_b == 0, torch.ones_like(s_b), s_b))
    q = e2m1_round(blocks / (s_b * s_g)).reshape(r, k)  # [R, K] on the E2M1 grid
    return pack_pairs(e2m1_codes(q)), s_b.reshape(r, -1).to(torch.float8_e4m3fn), s_g


def nvfp4_unpack(packed: torch.Tensor, block_scales: torch.Tensor, s_g: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, K]`` values of :func:`nvfp4_pack`'s output."""
    q = e2m1_values(unpack_pairs(packed))  # [R, K]
    s = block_scales.float().repeat_interleave(BLOCK_SIZE, dim=1)  # [R, K]
    return q * (s * s_g)


def _fp4_gemm(a_packed, a_scales, a_global, b_packed, b_scales, b_global, out_dtype, bias=None) -> torch.Tensor:
    """``A [M, K] @ B [N, K]^T`` from packed operands (scales swizzled) -> ``[M, N]``."""
    rec = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return F.scaled_mm(a_packed.view(torch.float4_e2m1fn_x2), b_packed.view(torch.float4_e2m1fn_x2).t(),
                       scale_a=[a_scales, a_global], scale_recipe_a=rec, scale_b=[b_scales, b_global],
                       scale_recipe_b=rec, swizzle_a=swz, swizzle_b=swz, bias=bias, output_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def nvfp4_gemm_problem(device: str) -> Optional[str]:
    """None if real NVFP4 GEMMs run on ``device`` and agree with the emulated numerics, else why not."""
    if not (hasattr(torch, "float4_e2m1fn_x2") and hasattr(F, "scaled_mm") and hasattr(F, "SwizzleType")):
        return f"torch {torch.__version__} has no float4_e2m1fn_x2 / torch.nn.functional.scaled_mm (needs torch 2.10+)"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"real NVFP4 GEMMs run on CUDA sm_100+ (Blackwell) only; the model is on {dev}"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (10, 0):
        return (f"real NVFP4 GEMMs need an sm_100+ GPU (Blackwell); this one is sm_{cap[0]}{cap[1]} "
                f"({torch.cuda.get_device_name(dev)})")
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(128, 64, generator=g).to(dev)  # [M, K]
        b = torch.randn(32, 64, generator=g).to(dev)  # [N, K]
        pa, sa, ga = nvfp4_pack(a, a.abs().amax())
        pb, sb, gb = nvfp4_pack(b, b.abs().amax())
        y = _fp4_gemm(pa, swizzle_scales(sa), ga, pb, swizzle_scales(sb), gb, torch.float32)  # [128, 32]
        ref = nvfp4_fake_quant(a, a.abs().amax()) @ nvfp4_fake_quant(b, b.abs().amax()).t()
        err = float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        if not err < 1e-3:
            return f"the real NVFP4 GEMM disagreed with the emulated numerics on {device} (relative error {err:.2e})"
    except Exception as e:  # noqa: BLE001 - any failure means the kernel is unusable here
        return f"torch {torch.__version__} NVFP4 scaled_mm failed on {device}: {type(e).__name__}: {e}"
    return None


class NVFP4Linear(nn.Module):
    """``y = x W^T + b`` as a real NVFP4 GEMM (module doc); static input global scale.

    Args:
        linear: the full-precision layer (its weight is packed once, not kept).
        input_amax: calibrated absolute maximum of the layer's input.
    """

    def __init__(self, linear: nn.Linear, input_amax: float):
        super().__init__()
        w = linear.weight.detach()  # [N, K]
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])
        self.pad_k = (-self.in_features) % K_ALIGN
        self.pad_n = (-self.out_features) % 16
        wf = F.pad(w.float(), (0, self.pad_k, 0, self.pad_n))  # [Np, Kp]
        packed, scales, s_g = nvfp4_pack(wf, wf.abs().amax())
        self.register_buffer("weight_packed", packed)  # [Np, Kp / 2] uint8
        self.register_buffer("weight_scales", swizzle_scales(scales))  # flat float8_e4m3fn
        self.register_buffer("weight_global", s_g.float())  # []
        self.register_buffer("input_amax", torch.tensor(max(float(input_amax), 1e-12), device=w.device))  # []
        b = None if linear.bias is None else F.pad(linear.bias.detach(), (0, self.pad_n)).to(torch.bfloat16)
        self.register_buffer("bias", b)  # [Np]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.pad_k:
            x2 = F.pad(x2, (0, self.pad_k))  # [M, Kp]
        packed, scales, s_g = nvfp4_pack(x2, self.input_amax)
        y = _fp4_gemm(packed, swizzle_scales(scales), s_g, self.weight_packed, self.weight_scales, self.weight_global,
                      torch.bfloat16, self.bias)  # [M, Np]
        if self.pad_n:
            y = y[:, : self.out_features]
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"max_input={float(self.input_amax):.3g}")


__all__ = ["NVFP4Linear", "e2m1_codes", "e2m1_values", "nvfp4_gemm_problem", "nvfp4_pack",
           "nvfp4_unpack", "pack_pairs", "swizzle_scales", "unpack_pairs"]
