"""Image grids: a batch of images as one uint8 array, and as a PNG file."""
from __future__ import annotations

import math
import os
from typing import Union

import numpy as np
import torch

from .io import save_png


def image_grid(images: torch.Tensor, nrow: int, pad: int = 1, scale: int = 1) -> np.ndarray:
    """``[N, 3, H, W]`` in [0, 1] -> ``[rows*(H+pad)+pad, nrow*(W+pad)+pad, 3]`` uint8 (``scale``x
    nearest upsampling, grey padding)."""
    x = images.detach().float().clamp(0, 1).cpu()  # [N, 3, H, W]
    if scale > 1:
        x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3)  # [N, 3, H*s, W*s]
    n, c, h, w = x.shape
    rows = math.ceil(n / nrow)
    grid = torch.ones(c, rows * (h + pad) + pad, nrow * (w + pad) + pad) * 0.5  # [3, H', W']
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + col * (w + pad): pad + col * (w + pad) + w] = x[i]
    return (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)  # [H', W', 3]


def save_grid(images: torch.Tensor, path: Union[str, os.PathLike], nrow: int, scale: int = 1) -> None:
    """:func:`image_grid` of ``images`` written as a PNG atomically."""
    save_png(image_grid(images, nrow, scale=scale), path)
