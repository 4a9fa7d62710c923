"""Decoding through a Wan-style causal video VAE (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``), shared by
the adapters whose VAE is one: Wan (videos) and Qwen-Image (one-frame videos, returned as images)."""
from __future__ import annotations

from typing import Optional

import torch

from .common import DECODE_BATCH, module_dtype


def video_vae_decode(vae, latents: torch.Tensor, device, batch: Optional[int] = DECODE_BATCH) -> torch.Tensor:
    """Latents ``[B, C, F', h, w]`` -> float32 videos ``[B, 3, F, f h, f w]`` in [0, 1] through a
    Wan-style causal video VAE (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``), as the Wan and
    Qwen-Image pipelines decode: ``latents / (1 / latents_std) + latents_mean`` per channel, VAE
    decode (``[-1, 1]``), ``x / 2 + 0.5`` clamped. ``batch`` videos per VAE call (None: all)."""
    cfg = vae.config
    dtype = module_dtype(vae)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)  # [1, C, 1, 1, 1]
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)  # [1, C, 1, 1, 1]
    step = batch or max(1, len(latents))
    out = []
    for i in range(0, len(latents), step):
        z = latents[i:i + step].to(device, dtype) / inv_std + mean  # [b, C, F', h, w]
        with torch.no_grad():
            video = vae.decode(z, return_dict=False)[0]  # [b, 3, F, H, W] in [-1, 1]
        out.append((video.float() / 2 + 0.5).clamp(0, 1))
    return torch.cat(out)  # [B, 3, F, H, W]


__all__ = ["video_vae_decode"]
