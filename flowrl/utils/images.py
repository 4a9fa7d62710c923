"""Image grids: a batch of images as one uint8 array, and as a PNG file; :func:`labeled_grid` adds what a
person needs to read one (a caption per row, the source images of an edit)."""
from __future__ import annotations

import math
import os
from typing import Optional, Union

import numpy as np
import torch

from .io import save_png


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Floats in [0, 1], any shape -> uint8 ``round(255 x)`` (clamped, detached; the device kept): what an 8-bit
    file holds of them, as the references' PIL conversion rounds."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)


def to_pil(image: torch.Tensor):
    """``[3, H, W]`` float in [0, 1] -> RGB PIL image of ``round(255 x)`` (:func:`to_uint8`)."""
    from PIL import Image

    return Image.fromarray(to_uint8(image).permute(1, 2, 0).cpu().numpy())  # [H, W, 3]


def image_grid(images: torch.Tensor, nrow: int, pad: int = 1, scale: int = 1, background: float = 0.5) -> np.ndarray:
    """``[N, 3, H, W]`` in [0, 1] -> ``[rows*(H+pad)+pad, nrow*(W+pad)+pad, 3]`` uint8 (``scale``x
    nearest upsampling, padding of grey level ``background``)."""
    x = images.detach().float().clamp(0, 1).cpu()  # [N, 3, H, W]
    if scale > 1:
        x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3)  # [N, 3, H*s, W*s]
    n, c, h, w = x.shape
    rows = math.ceil(n / nrow)
    grid = torch.ones(c, rows * (h + pad) + pad, nrow * (w + pad) + pad) * background  # [3, H', W']
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + col * (w + pad): pad + col * (w + pad) + w] = x[i]
    return (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)  # [H', W', 3]


def save_grid(images: torch.Tensor, path: Union[str, os.PathLike], nrow: int, scale: int = 1) -> None:
    """:func:`image_grid` of ``images`` written as a PNG atomically."""
    save_png(image_grid(images, nrow, scale=scale), path)


# ---------------------------------------------------------------- grids people read: captions and source images
CAPTION_PX = 14  # height of a caption band (one line of PIL's default font at 11 px)
SEPARATOR = 0.15  # grey level of the line between a row's source images and its samples


def text_band(text: str, width: int, height: int = CAPTION_PX) -> np.ndarray:
    """One line of dark ``text`` on white, ``[height, width, 3]`` uint8; cut with "..." to fit ``width``."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (max(1, width), height), "white")
    draw, font = ImageDraw.Draw(img), ImageFont.load_default(size=height - 3)
    shown = text
    while shown and draw.textlength(shown if shown == text else shown + "…", font=font) > width - 4:
        shown = shown[:-1]
    draw.text((2, 1), shown if shown == text else shown.rstrip() + "…", fill=(20, 20, 20), font=font)
    return np.asarray(img)


def _as_list(sources) -> list:
    if sources is None:
        return []
    return [sources] if isinstance(sources, torch.Tensor) else [s for s in sources if s is not None]


def _fit(image: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """A source image ``[3, h', w']`` (any size, [0, 1]) resized to a sample's cell ``[3, h, w]``."""
    x = image.detach().float().cpu()[:3]
    if x.shape[0] == 1:
        x = x.expand(3, -1, -1)
    if tuple(x.shape[1:]) != (h, w):
        x = torch.nn.functional.interpolate(x[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    return x.clamp(0, 1)


def labeled_grid(images: torch.Tensor, nrow: int, scale: int = 1, labels=None, sources=None, pad: int = 1,
                 background: float = 0.5, source_size: Optional[tuple[int, int]] = None) -> np.ndarray:
    """:func:`image_grid` for people: grid row ``r`` (images ``r*nrow ... r*nrow+nrow-1``; never an empty
    column) under the caption ``labels[r]`` (a prompt, an edit instruction), after its source image(s)
    ``sources[r]`` (None, one ``[3, H, W]`` tensor, or a list of them: an edit's inputs, resized to
    ``source_size``, default the cell's) and a dark separator; a header names the two parts when there
    are sources. ``pad`` pixels of grey ``background`` between cells. ``[H', W', 3]`` uint8."""
    n = images.shape[0]
    nrow = max(1, min(nrow, n))
    rows = -(-n // nrow)
    sh, sw = source_size or tuple(images.shape[-2:])
    per_row = [_as_list(sources[r]) if sources is not None and r < len(sources) else [] for r in range(rows)]
    k = max((len(s) for s in per_row), default=0)
    parts = []
    for r in range(rows):
        cells = image_grid(images[r * nrow:(r + 1) * nrow], nrow, pad=pad, scale=scale, background=background)
        if k:
            src = torch.full((k, 3, sh, sw), background)  # [k, 3, H, W]
            for j, s in enumerate(per_row[r]):
                src[j] = _fit(s, sh, sw)
            src_cells = image_grid(src, k, pad=pad, scale=scale, background=background)
            src_cells = np.pad(src_cells, ((0, cells.shape[0] - src_cells.shape[0]), (0, 0), (0, 0)),
                               constant_values=round(background * 255))
            line = np.full((cells.shape[0], 3, 3), round(SEPARATOR * 255), np.uint8)
            cells = np.concatenate([src_cells, line, cells], axis=1)
        if labels is not None and r < len(labels):
            cells = np.concatenate([text_band(str(labels[r]), cells.shape[1]), cells], axis=0)
        elif r:
            cells = cells[pad:]  # the row above ends in the padding between rows
        parts.append(cells)
    width = max(p.shape[1] for p in parts)
    parts = [np.pad(p, ((0, 0), (0, width - p.shape[1]), (0, 0)), constant_values=round(background * 255))
             for p in parts]
    grid = np.concatenate(parts, axis=0)
    if k:
        src_w = k * (sw * scale + pad) + pad
        head = np.concatenate([text_band("source" if k == 1 else "sources", src_w + 3),
                               text_band("results", width - src_w - 3)], axis=1)
        grid = np.concatenate([head, grid], axis=0)
    return grid
