"""``pickscore``: PickScore (Kirstain et al. 2023), a CLIP-H/14 fine-tuned on Pick-a-Pic preferences.

reward = ``logit_scale * cos(image, text) / 26``: PickScore's logit divided by 26, the
normalisation of Flow-GRPO's ``pickscore_scorer.py`` (raw PickScore is about 18-23 for
SD-class images, so the reward sits near 0.7-0.9).

Weights ``yuvalkirstain/PickScore_v1`` (transformers ``CLIPModel``); its processor lives in
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``. Both load with ``from_pretrained`` from a local
directory or the Hugging Face cache.
"""
from __future__ import annotations

from typing import Optional

from flowrl.options import Device, ModelSource, PositiveFloat, PositiveInt

from ._clip_common import DTypeLike, ScaledCosineReward

PICKSCORE_DIVISOR = 26.0


class PickScore(ScaledCosineReward):
    """PickScore / 26 per (image, prompt) pair; float32 [B] on CPU."""

    name = "pickscore"
    resident_params = 986_100_000  # parameters kept loaded, for `flowrl plan` (bytes: x the dtype option)
    resident_note = "yuvalkirstain/PickScore_v1 = CLIP ViT-H-14 (open_clip profile: 986.1M)"

    def __init__(self, model: ModelSource = "yuvalkirstain/PickScore_v1",
                 processor: Optional[ModelSource] = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
                 device: Device = "cpu", dtype: DTypeLike = "float32", divisor: PositiveFloat = PICKSCORE_DIVISOR,
                 batch_size: PositiveInt = 32):
        super().__init__(model, processor, device=device, dtype=dtype, divisor=divisor, batch_size=batch_size)
