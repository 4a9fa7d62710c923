"""2x2 patch packing, shared by the adapters whose transformer sees latents as packed tokens.

FLUX.1, FLUX.1 Kontext, Qwen-Image and FLUX.2 keep their latents **unpacked** and image-shaped,
``[B, C, h, w]`` (``h = H / 8``), so step functions, stored transitions and rewards see the same
layout as for SD3; their ``velocity`` packs the latents into the transformer's token sequence of 2x2
patches, ``[B, (h/2)(w/2), 4C]``, and unpacks the prediction. The channel order inside a token is
``(c, dy, dx)`` and tokens run row-major: ``FluxPipeline._pack_latents`` / ``_unpack_latents``,
``QwenImagePipeline``'s (its frame axis of length 1 does not change the layout) and FLUX.2's
``_patchify_latents`` followed by ``_pack_latents``.
"""
from __future__ import annotations

import torch

from .facts import ModelConfigs


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]`` 2x2 patches, row-major (``FluxPipeline._pack_latents``)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)  # [B, (h/2)(w/2), 4C]


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pack_latents``: ``[B, (h/2)(w/2), 4C]`` -> ``[B, C, h, w]`` (``h, w`` in latent pixels)."""
    b, _, c4 = x.shape
    x = x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # [B, C, h/2, 2, w/2, 2]
    return x.reshape(b, c4 // 4, h, w)  # [B, C, h, w]


def latent_image_ids(h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """RoPE position ids of the packed image tokens ``[(h/2)(w/2), 3]``: (0, row, col)
    (``FluxPipeline._prepare_latent_image_ids``)."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)  # built on the device: no host-to-device copy
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype=dtype)  # [(h/2)(w/2), 3]


class PackedLatents:
    """Model facts of an adapter whose transformer sees 2x2 patches packed into tokens (FLUX.1,
    FLUX.1 Kontext, Qwen-Image, FLUX.2): the latents are declared unpacked, ``[B, in_channels / 4, h, w]``."""

    @classmethod
    def latent_channels(cls, transformer: dict) -> int:
        """Unpacked latent channels: the transformer sees 2x2 patches of them (``in_channels / 4``)."""
        return int(transformer["in_channels"]) // 4

    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        return 2  # the 2x2 packing

    @classmethod
    def default_resolution(cls, configs: ModelConfigs) -> int:
        return 128 * cls.vae_factor(configs)  # the pipelines' default: 1024 px at a VAE factor of 8

    @classmethod
    def transformer_output(cls, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The packed prediction ``[B, (h/2)(w/2), 4C]`` unpacked like the latents ``x`` ``[B, C, h, w]``."""
        return unpack_latents(out, *x.shape[-2:])  # [B, C, h, w]


__all__ = ["PackedLatents", "latent_image_ids", "pack_latents", "unpack_latents"]
