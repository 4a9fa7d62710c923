"""GenEval's detector on transformers: ``Mask2FormerForUniversalSegmentation`` with mmdetection's
test-time pipeline and instance post-processing, and the output contract every detector meets.

The contract (:func:`check_detections`): a detector is a callable taking float images ``[B, 3, H,
W]`` in [0, 1] and returning, per image, a dict ``{COCO class name: [(x0, y0, x1, y1, score[,
mask]), ...]}`` in pixels of that image, ``mask`` an optional boolean ``[H, W]``. flowrl applies
GenEval's thresholds, per-class limit, ordering and rules itself (:mod:`flowrl.rewards.geneval_rules`).

:class:`Mask2FormerDetector` follows GenEval's mmdetection 2.x evaluator step by step
(``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``'s ``test_pipeline`` and
``MaskFormerFusionHead.instance_postprocess``): the 8-bit image resized with its aspect ratio kept
to fit 1333 x 800 (scale ``min(1333 / long, 800 / short)``, sizes rounded half up, bilinear),
normalised with ImageNet's mean and std in 0-255 units, zero-padded to a multiple of 32; mask
logits upsampled (bilinear) to the padded size, cropped, resized to the original image; the top
``max_per_image`` (100) (query, class) pairs by softmax score; binary masks ``logit > 0``; score =
class probability x mean mask probability inside the mask; box = the mask's extent
(``x1 = last column + 1``). What differs from GenEval's own detector is the weights (docs/rewards.md).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from flowrl.errors import ConfigError

from ._clip_common import chunks, from_pretrained, require, resolve_dtype
from .geneval_rules import COCO_CLASSES

MMDET_MEAN = (123.675, 116.28, 103.53)  # mmdet img_norm_cfg, RGB, 0-255 units
MMDET_STD = (58.395, 57.12, 57.375)
DEFAULT_MODEL = "facebook/mask2former-swin-small-coco-instance"


def check_detections(out, n: int, height: int, width: int, name: str) -> list[dict]:
    """A detector's output checked against the contract (module doc) and normalised to
    ``[{class: [(box float [5], mask bool [H, W] or None), ...]}]``; a :class:`ConfigError` naming the
    detector and what was wrong otherwise."""
    form = ("one dict per image {class name: [(x0, y0, x1, y1, score[, mask bool [H, W]]), ...]}")
    if not isinstance(out, (list, tuple)) or len(out) != n:
        got = f"{type(out).__name__} of length {len(out)}" if isinstance(out, (list, tuple)) else type(out).__name__
        raise ConfigError(f"GenEval detector {name} returned {got} for {n} images; it must return {form}")
    result = []
    for i, per in enumerate(out):
        if not isinstance(per, dict):
            raise ConfigError(f"GenEval detector {name}: image {i} gave a {type(per).__name__}; it must return {form}")
        result.append({str(k): [_one_detection(d, name, i, k, height, width, form) for d in v] for k, v in per.items()})
    return result


def _one_detection(d, name: str, i: int, cls: str, height: int, width: int, form: str) -> tuple:
    where = f"GenEval detector {name}: image {i}, class {cls!r}"
    if not isinstance(d, (list, tuple)) or len(d) not in (5, 6):
        raise ConfigError(f"{where}: a detection must be (x0, y0, x1, y1, score[, mask]), got {type(d).__name__}"
                          f"{f' of length {len(d)}' if isinstance(d, (list, tuple)) else ''}; return {form}")
    try:
        box = np.array([float(v) for v in d[:5]], dtype=np.float64)  # [5]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: box and score must be numbers, got {list(d[:5])!r}") from None
    if not np.isfinite(box).all() or box[2] < box[0] or box[3] < box[1]:
        raise ConfigError(f"{where}: box {box[:4].tolist()} must be finite with x1 >= x0 and y1 >= y0 (pixels)")
    mask = d[5] if len(d) == 6 else None
    if mask is not None:
        mask = mask.detach().cpu().numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask)
        if mask.shape != (height, width) or mask.dtype != np.bool_:
            raise ConfigError(f"{where}: mask must be a boolean [H, W] = [{height}, {width}] array, got "
                              f"{mask.dtype} {list(mask.shape)}")
    return box, mask


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Boolean masks ``[N, H, W]`` -> their extents ``[N, 4]`` float ``(x0, y0, x_last + 1, y_last + 1)``;
    zeros for an empty mask (mmdet's ``mask2bbox``)."""
    n = masks.shape[0]
    boxes = torch.zeros(n, 4)
    cols, rows = masks.any(dim=1), masks.any(dim=2)  # [N, W], [N, H]
    for i in range(n):
        x, y = torch.where(cols[i])[0], torch.where(rows[i])[0]
        if len(x) and len(y):
            boxes[i] = torch.tensor([float(x[0]), float(y[0]), float(x[-1]) + 1, float(y[-1]) + 1])
    return boxes


def instance_postprocess(cls_logits: torch.Tensor, mask_logits: torch.Tensor, max_per_image: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One image's ``cls_logits [Q, C + 1]`` (last: no object) and ``mask_logits [Q, H, W]`` ->
    (labels [K], boxes [K, 5] with the score last, masks bool [K, H, W]), K = min(max_per_image, Q C)."""
    num_classes = cls_logits.shape[-1] - 1
    scores = F.softmax(cls_logits.float(), dim=-1)[:, :-1]  # [Q, C]
    top_scores, top = scores.flatten().topk(min(max_per_image, scores.numel()), sorted=False)  # [K]
    labels = top % num_classes
    masks = mask_logits[top // num_classes].float()  # [K, H, W]
    binary = masks > 0
    mask_scores = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)  # [K]
    det = top_scores * mask_scores
    boxes = torch.cat([mask_boxes(binary.cpu()), det.cpu()[:, None]], dim=-1)  # [K, 5]
    return labels.cpu(), boxes, binary.cpu()


def resized_size(height: int, width: int, long_side: int = 1333, short_side: int = 800) -> tuple[int, int]:
    """mmcv ``imrescale``: the size fitting ``long_side`` x ``short_side`` with the aspect ratio kept."""
    scale = min(long_side / max(height, width), short_side / min(height, width))
    return int(height * scale + 0.5), int(width * scale + 0.5)


class Mask2FormerDetector:
    """GenEval's Mask2Former on transformers (module doc): ``model`` a local directory made with
    ``save_pretrained`` or a Hugging Face id in the local cache (default the Swin-S COCO instance
    checkpoint); ``batch_size`` images per forward pass (resized to one size they share)."""

    resident_params = 69_000_000  # Mask2Former Swin-S, for `flowrl plan` (the geneval reward's resident size)

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32", batch_size: int = 4,
                 max_per_image: int = 100, long_side: int = 1333, short_side: int = 800,
                 class_names: Optional[Sequence[str]] = None):
        transformers = require("transformers", "transformers")
        net = from_pretrained(transformers.Mask2FormerForUniversalSegmentation.from_pretrained, model,
                              "Mask2Former detector")
        self.device, self.dtype = torch.device(device), resolve_dtype(dtype)
        self.model = net.eval().requires_grad_(False).to(self.device, self.dtype)
        n = int(self.model.config.num_labels)
        if class_names is None:
            class_names = COCO_CLASSES if n == len(COCO_CLASSES) else [self.model.config.id2label[i] for i in range(n)]
        if len(class_names) != n:
            raise ConfigError(f"class_names has {len(class_names)} names for a detector of {n} classes")
        self.class_names = list(class_names)
        self.batch_size, self.max_per_image = int(batch_size), int(max_per_image)
        self.long_side, self.short_side = int(long_side), int(short_side)

    def _inputs(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        h, w = resized_size(images.shape[-2], images.shape[-1], self.long_side, self.short_side)
        x = (images.float().clamp(0, 1) * 255).round()  # [b, 3, H, W] the 8-bit image
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)  # [b, 3, h, w]
        mean = torch.tensor(MMDET_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(MMDET_STD).view(1, 3, 1, 1)
        x = (x - mean) / std
        ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
        return F.pad(x, (0, pw - w, 0, ph - h)), (h, w)  # [b, 3, ph, pw], zero padding after normalising

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> list[dict]:
        height, width = images.shape[-2:]
        out: list[dict] = []
        for s in chunks(images.shape[0], self.batch_size):
            pixels, (h, w) = self._inputs(images[s].cpu())
            res = self.model(pixel_values=pixels.to(self.device, self.dtype))
            masks = F.interpolate(res.masks_queries_logits.float(), size=pixels.shape[-2:], mode="bilinear",
                                  align_corners=False)[..., :h, :w]  # [b, Q, h, w]
            masks = F.interpolate(masks, size=(height, width), mode="bilinear", align_corners=False)  # [b, Q, H, W]
            for cls_logits, mask_logits in zip(res.class_queries_logits, masks):
                labels, boxes, binary = instance_postprocess(cls_logits, mask_logits, self.max_per_image)
                per: dict[str, list] = {}
                for label, box, m in zip(labels.tolist(), boxes.tolist(), binary.numpy()):
                    per.setdefault(self.class_names[label], []).append((*box, m))
                out.append(per)
        return out
