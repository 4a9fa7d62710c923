"""GenEval's own detector, mmdetection 2.x's Mask2Former, as a ``geneval`` detector.

For an environment that has mmdet 2.x and mmcv-full (GenEval's evaluator stack, which conflicts with
the trainer's), where ``flowrl serve-reward geneval`` runs with
``detector=flowrl.rewards.geneval_mmdet:MMDetDetector`` (docs/rewards.md). The detector is GenEval's:
``init_detector(config, checkpoint)`` and ``inference_detector`` on each 8-bit image (RGB converted to
the BGR mmdet's pipeline loads from files), whose per-class ``[n, 5]`` boxes and masks pass to
flowrl's rules unchanged (:func:`mmdet_to_detections`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ._clip_common import require
from .geneval_rules import COCO_CLASSES

CONFIG = "configs/mask2former/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py"  # relative to mmdetection's root


def mmdet_to_detections(result, class_names: Sequence[str] = COCO_CLASSES) -> dict:
    """One mmdet 2.x result (``bbox`` per class ``[n, 5]``, or ``(bbox, segm)`` with a list of
    boolean ``[H, W]`` masks per class) -> ``{class: [(x0, y0, x1, y1, score[, mask]), ...]}``."""
    bbox = result[0] if isinstance(result, tuple) else result
    segm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    out = {}
    for c, name in enumerate(class_names):
        boxes = np.asarray(bbox[c]).reshape(-1, 5)
        if len(boxes):
            out[name] = [(*map(float, b), np.asarray(segm[c][j], dtype=bool)) if segm is not None
                         else tuple(map(float, b)) for j, b in enumerate(boxes)]
    return out


class MMDetDetector:
    """GenEval's Mask2Former through mmdetection 2.x (module doc). ``config``: the model config file
    (default GenEval's, under ``mmdet_root``); ``checkpoint``: its ``.pth``."""

    resident_params = 69_000_000  # GenEval's Mask2Former Swin-S, for `flowrl plan`

    def __init__(self, checkpoint: str, config: Optional[str] = None, mmdet_root: Optional[str] = None,
                 device: str = "cuda", class_names: Optional[Sequence[str]] = None):
        apis = require("mmdet.apis", "mmdet==2.* and mmcv-full (GenEval's evaluator environment)")
        if config is None:
            import os

            import mmdet

            root = mmdet_root or os.path.join(os.path.dirname(mmdet.__file__), "..")
            config = os.path.join(root, CONFIG)
        self.model = apis.init_detector(config, checkpoint, device=device)
        self.inference = apis.inference_detector
        self.class_names = list(class_names or COCO_CLASSES)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> list[dict]:
        pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # [B, 3, H, W]
        bgr = [np.ascontiguousarray(p.permute(1, 2, 0).cpu().numpy()[..., ::-1]) for p in pixels]  # [H, W, 3]
        return [mmdet_to_detections(r, self.class_names) for r in self.inference(self.model, bgr)]
