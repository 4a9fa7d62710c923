"""The shapes world's detector and colour reader, for GenEval's rules on images of that world.

Not a photo detector: an exact reader of :mod:`flowrl.data.shapes`' renders (flat :data:`PALETTE`
colours on a light grey :data:`BACKGROUND`), so a model trained on that world is judged by GenEval's
official rules (:mod:`flowrl.rewards.geneval_rules`) without a COCO detector that has never seen a
flat triangle. Plug it into the ``geneval`` reward::

    reward.options.geneval.detector: flowrl.rewards.shapes_detector:ShapesDetector
    reward.options.geneval.colors: flowrl.rewards.shapes_detector:PaletteColors

:class:`ShapesDetector` (the contract of :func:`flowrl.rewards.geneval_detectors.check_detections`):
each pixel takes the nearest of the palette colours and the background (RGB distance, 0-255 units),
and the background when it is farther than ``max_distance`` from every palette colour; the pixels
of one colour split into connected components (8-neighbours; holes filled), components under
``min_area`` pixels are dropped, and each remaining one is the shape whose template
(:func:`flowrl.data.shapes.shape_mask`, drawn at the component's box over a small grid of centres
and sides) overlaps it best. score = that best IoU (1.0 on a render, so it passes the ``counting``
tag's 0.9; a smudge or a blend of two shapes scores lower); box = the mask's extent (``x1`` = last
column + 1). On a render of any scene the detections are the scene's objects exactly (class, box,
mask: ``tests/test_shapes_detector.py``).

:class:`PaletteColors` (the ``colors`` callable of the ``geneval`` reward): the colour of a
detection is the palette colour most of its masked pixels are nearest (pixels nearer the background
do not vote); one without any is ``white``, the GenEval colour of the light grey background, which
no shapes prompt asks for.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from flowrl.data.shapes import BACKGROUND, PALETTE, SHAPES, extent, shape_mask
from flowrl.options import NonNegativeFloat, PositiveInt

COLOR_NAMES = tuple(PALETTE)
REFERENCES = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float64)  # [1 + colours, 3] 0-255: 0 = background
NO_COLOR = "white"  # the GenEval colour of the light grey background
CENTRE_STEPS = np.linspace(-0.5, 0.5, 5)  # template centres tried around the box's centre, pixels
SIDE_STEPS = np.linspace(-1.0, 2.0, 13)  # template sides tried around the box's longer side, pixels
PAD = 2  # pixels of margin around a component when its templates are drawn


def palette_labels(pixels: np.ndarray, max_distance: float) -> np.ndarray:
    """Pixels ``[..., 3]`` (0-255) -> int ``[...]``: 0 the background, ``k`` the ``k``-th palette colour
    (1-based, :data:`COLOR_NAMES` order): the nearest reference, background when farther than
    ``max_distance`` from every palette colour."""
    d = np.linalg.norm(np.asarray(pixels, dtype=np.float64)[..., None, :] - REFERENCES, axis=-1)  # [..., 1 + K]
    labels = d.argmin(axis=-1)
    labels[d[..., 1:].min(axis=-1) > max_distance] = 0
    return labels


def fit_shape(mask: np.ndarray) -> tuple[str, float]:
    """The shape whose template best covers a component, and that IoU: templates drawn with
    :func:`~flowrl.data.shapes.shape_mask` over a grid of centres (:data:`CENTRE_STEPS` around the
    box centre) and sides (:data:`SIDE_STEPS` around the box's longer side), on a square window
    around the box; ties go to the first of :data:`SHAPES`."""
    x0, y0, x1, y1 = extent(mask)
    side = max(x1 - x0, y1 - y0) + 2 * PAD
    ox, oy = x0 - PAD, y0 - PAD
    window = np.zeros((side, side), dtype=bool)  # the component in window coordinates
    ys, xs = np.nonzero(mask)
    window[ys - oy, xs - ox] = True
    cx, cy, s = np.meshgrid((x0 + x1) / 2 - ox + CENTRE_STEPS, (y0 + y1) / 2 - oy + CENTRE_STEPS,
                            max(x1 - x0, y1 - y0) + SIDE_STEPS, indexing="ij")
    cx, cy, s = (a.reshape(-1, 1, 1) for a in (cx, cy, s))  # [P, 1, 1] each
    best, best_iou = SHAPES[0], -1.0
    for kind in SHAPES:
        t = shape_mask(kind, cx, cy, s, side)  # [P, side, side]
        inter = (t & window).sum(axis=(1, 2))
        union = (t | window).sum(axis=(1, 2))
        iou = float((inter / np.maximum(union, 1)).max())
        if iou > best_iou:
            best, best_iou = kind, iou
    return best, best_iou


def to_pixels(images: torch.Tensor) -> np.ndarray:
    """Float images ``[B, 3, H, W]`` in [0, 1] -> float64 ``[B, H, W, 3]`` in 0-255."""
    return images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy().astype(np.float64) * 255


class ShapesDetector:
    """GenEval detections of the shapes world's objects (module doc): ``max_distance`` (RGB, 0-255)
    beyond which a pixel is background, ``min_area`` (pixels) below which a component is noise."""

    resident_params = 0  # no weights: `flowrl plan` counts nothing for it

    def __init__(self, max_distance: NonNegativeFloat = 100.0, min_area: PositiveInt = 8):
        self.max_distance, self.min_area = float(max_distance), int(min_area)

    def detect(self, pixels: np.ndarray) -> dict[str, list]:
        """One image ``[H, W, 3]`` (0-255) -> ``{shape: [(x0, y0, x1, y1, score, mask), ...]}``."""
        from scipy import ndimage

        labels = palette_labels(pixels, self.max_distance)  # [H, W]
        out: dict[str, list] = {}
        for k in range(1, len(REFERENCES)):
            parts, n = ndimage.label(labels == k, structure=np.ones((3, 3), dtype=bool))  # [H, W], 8-neighbours
            for j in range(1, n + 1):
                mask = ndimage.binary_fill_holes(parts == j)  # [H, W]
                if mask.sum() < self.min_area:
                    continue
                kind, score = fit_shape(mask)
                out.setdefault(kind, []).append((*map(float, extent(mask)), score, mask))
        return out

    def __call__(self, images: torch.Tensor) -> list[dict]:
        return [self.detect(p) for p in to_pixels(images)]


class PaletteColors:
    """``colors(image uint8 [H, W, 3], class name, detections) -> [colour per detection]``: the palette
    colour of most of each detection's masked pixels (its box when it has no mask; module doc)."""

    resident_params = 0  # no weights

    def __init__(self, max_distance: NonNegativeFloat = 100.0):
        self.max_distance = float(max_distance)

    def color(self, image: np.ndarray, box: Sequence[float], mask: Optional[np.ndarray]) -> str:
        if mask is None:
            h, w = image.shape[:2]
            x0, y0 = max(int(round(box[0])), 0), max(int(round(box[1])), 0)
            mask = np.zeros((h, w), dtype=bool)
            mask[y0:max(int(round(box[3])), y0), x0:max(int(round(box[2])), x0)] = True
        votes = np.bincount(palette_labels(image[mask], self.max_distance), minlength=len(REFERENCES))[1:]  # [K]
        return COLOR_NAMES[int(votes.argmax())] if votes.any() else NO_COLOR

    def __call__(self, image: np.ndarray, class_name: str, detections: Sequence) -> list[str]:
        return [self.color(np.asarray(image), box, mask) for box, mask in detections]
