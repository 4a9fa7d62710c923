"""``clipscore``: CLIP text-image similarity (CLIPScore, Hessel et al. 2021), Flow-GRPO's scaling.

reward = ``logit_scale * cos(image, text) / divisor``: the diagonal of CLIP's
``logits_per_image`` over ``divisor``. With OpenAI CLIP (``logit_scale`` = 100) and the
default ``divisor=30`` this is Flow-GRPO's ``clip_scorer.py`` (``logits_per_image.diagonal()/30``),
about 0.6-1.1 for matching pairs. Hessel's CLIPScore is ``2.5 * max(cos, 0)``; use
``divisor=40`` for ``2.5 * cos`` (no clipping at 0).

Default weights: ``openai/clip-vit-large-patch14`` (transformers ``CLIPModel``), loaded with
``from_pretrained`` from a local directory or the Hugging Face cache.

Preprocessing (``preprocess``): the references disagree. ``"torchvision"`` (default) is Flow-GRPO's
``clip_scorer.py``: torchvision ``Resize(224)`` (bilinear, its default) and ``CenterCrop(224)``
(rounded offset) on the float images, sizes and statistics from the processor's config.
``"transformers"`` is the model's ``CLIPImageProcessor`` (bicubic, floored crop offset), as
``CLIPProcessor`` users score it; the two differ by a few percent of the
score spread at 512 px.
"""
from __future__ import annotations

from typing import Optional

from flowrl.options import Device, ModelSource, PositiveFloat, PositiveInt

from ._clip_common import DTypeLike, Preprocess, ScaledCosineReward


class CLIPScore(ScaledCosineReward):
    """CLIP similarity of each image with its own prompt; float32 [B] on CPU."""

    name = "clipscore"
    resident_params = 427_600_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "openai/clip-vit-large-patch14 CLIPModel: 427.6M"

    def __init__(self, model: ModelSource = "openai/clip-vit-large-patch14", processor: Optional[ModelSource] = None,
                 device: Device = "cpu", dtype: DTypeLike = "float32", divisor: PositiveFloat = 30.0,
                 batch_size: PositiveInt = 32, preprocess: Preprocess = "torchvision"):
        super().__init__(model, processor, device=device, dtype=dtype, divisor=divisor, batch_size=batch_size,
                         preprocess=preprocess)
