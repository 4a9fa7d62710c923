"""JPEG (in)compressibility (DDPO, Black et al. 2023): file size of the image saved as JPEG.

Reward in kilobytes, negated for compressibility. ``quality`` 95 as in DDPO.
"""
from __future__ import annotations

import io
from typing import Annotated

import numpy as np
import torch
from PIL import Image

from flowrl.options import Between

from ._clip_common import check_inputs


def jpeg_kilobytes(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """``[B, 3, H, W]`` in [0, 1] -> JPEG size of each image in kB, float32 [B]."""
    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    sizes = []
    for a in arr:
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility:
    """``-kB``: smaller files score higher."""

    name = "jpeg_compressibility"
    resident_params = 0  # parameters kept loaded, for `flowrl plan`
    resident_note = "no model"

    def __init__(self, quality: Annotated[int, Between(1, 100)] = 95):
        self.quality = quality

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        return -jpeg_kilobytes(images, self.quality)


class JpegIncompressibility(JpegCompressibility):
    """``+kB``: larger files score higher."""

    name = "jpeg_incompressibility"

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        return jpeg_kilobytes(images, self.quality)
