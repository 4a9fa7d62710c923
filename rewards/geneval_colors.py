"""GenEval's colour classifier: CLIP zero-shot over GenEval's ten colours on each object's masked crop.

As djghosh13/geneval ``evaluate_images.py`` (``color_classification``, ``ImageCrops``) does it: the
image outside the object's mask is replaced by grey ``#999`` (``bgcolor``; no mask: the whole image),
cropped to the box (PIL's ``crop``, which rounds the coordinates), then open_clip's OpenAI transform
on the PIL crop (shorter side to the model's size, bicubic; centre crop; ImageNet-CLIP mean and std).
Each colour's text embedding is the normalised mean of the normalised embeddings of three templates
(``a photo of a {c} {class}``, ``a photo of a {c}-colored {class}``, ``a photo of a {c} object``:
clip_benchmark's ``zero_shot_classifier``); the colour is the argmax of ``100 x`` the cosine.

The CLIP is a transformers ``CLIPModel`` from a local directory or the Hugging Face cache (GenEval uses
open_clip's ``ViT-L-14`` with OpenAI's weights, the same weights as ``openai/clip-vit-large-patch14``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ._clip_common import HFClip, chunks
from .geneval_rules import COLORS

TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
DEFAULT_CLIP = "openai/clip-vit-large-patch14"


def masked_crop(image, box: Sequence[float], mask, bgcolor: str = "#999", crop: bool = True):
    """The PIL image of one object: outside ``mask`` (bool [H, W] or None) filled with ``bgcolor``,
    cropped to ``box`` ``(x0, y0, x1, y1, ...)`` (GenEval's ``ImageCrops``). ``image``: a PIL RGB image."""
    from PIL import Image

    if mask is not None:
        blank = image.copy() if bgcolor == "original" else Image.new("RGB", image.size, color=bgcolor)
        image = Image.composite(image, blank, Image.fromarray(np.asarray(mask)))
    return image.crop(tuple(float(v) for v in box[:4])) if crop else image


def openai_transform(crop, size: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """open_clip's eval transform on a PIL image (torchvision ``Resize(size)`` bicubic on PIL: shorter
    side to ``size``, the longer ``int(size * long / short)``; ``CenterCrop(size)`` with rounded offsets)
    -> float ``[3, size, size]`` normalised."""
    from PIL import Image

    w, h = crop.size
    if w <= h:
        nw, nh = size, int(size * h / w)
    else:
        nw, nh = int(size * w / h), size
    crop = crop.convert("RGB").resize((nw, nh), Image.BICUBIC)
    top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
    crop = crop.crop((left, top, left + size, top + size))
    x = torch.from_numpy(np.asarray(crop, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255  # [3, S, S]
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


class ClipColors:
    """``colors(image uint8 [H, W, 3], class name, detections) -> [colour per detection]`` (module doc)."""

    resident_params = 427_600_000  # CLIP ViT-L/14 (the default model), for `flowrl plan`

    def __init__(self, model: str = DEFAULT_CLIP, device: str = "cpu", dtype: str = "float32",
                 bgcolor: str = "#999", crop: bool = True, batch_size: int = 16):
        self.clip = HFClip(model, device=device, dtype=dtype)
        proc = self.clip.transform
        self.size = int(self.clip.model.config.vision_config.image_size)
        self.mean, self.std = tuple(proc.mean), tuple(proc.std)
        self.bgcolor, self.crop, self.batch_size = bgcolor, bool(crop), int(batch_size)
        self._classifiers: dict[str, torch.Tensor] = {}

    def classifier(self, class_name: str) -> torch.Tensor:
        """The zero-shot weights ``[D, 10]`` of one object class (cached)."""
        if class_name not in self._classifiers:
            cols = []
            for c in COLORS:
                emb = self.clip.embed_texts([t.format(c=c, cls=class_name) for t in TEMPLATES])  # [3, D] unit
                mean = emb.mean(dim=0)
                cols.append(mean / mean.norm())
            self._classifiers[class_name] = torch.stack(cols, dim=1)  # [D, 10]
        return self._classifiers[class_name]

    @torch.no_grad()
    def __call__(self, image: np.ndarray, class_name: str, detections: Sequence) -> list[str]:
        from PIL import Image

        pil = Image.fromarray(image)
        crops = torch.stack([openai_transform(masked_crop(pil, box, mask, self.bgcolor, self.crop), self.size,
                                              self.mean, self.std) for box, mask in detections])  # [n, 3, S, S]
        clf = self.classifier(class_name)
        picks = []
        for s in chunks(crops.shape[0], self.batch_size):
            pooled = self.clip.model.vision_model(pixel_values=crops[s].to(self.clip.device, self.clip.dtype)).pooler_output
            feats = F.normalize(self.clip.model.visual_projection(pooled).float(), dim=-1)  # [b, D]
            picks += (100.0 * feats @ clf).argmax(dim=1).tolist()
        return [COLORS[i] for i in picks]
