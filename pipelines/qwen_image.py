"""Qwen-Image (Wu et al. 2025) as a ``FlowPolicy``, over diffusers ``QwenImagePipeline`` components.

The math (unpacked ``[B, 16, h, w]`` latents packed into 2x2-patch tokens, sigma as the time input,
true CFG with the norm rescale, the pipeline's own schedule, the video VAE's frame axis) is
:class:`flowrl.pipelines.qwen_family.QwenFamilyPolicy`'s, which Qwen-Image-Edit shares. The
``QwenImageTransformer2DModel`` is the trainable part; the Qwen2.5-VL text encoder and the VAE are
frozen.

Prompts are encoded by the pipeline's own ``encode_prompt``: the system template, the last hidden
state of Qwen2.5-VL, the template's first 34 tokens dropped, at most ``max_sequence_length`` kept.
flowrl pads every prompt to ``max_sequence_length`` with its attention mask (batch-first
conditioning of one width); ``velocity`` trims the padding shared by the whole batch before the
transformer, whose joint attention masks the rest, so the image tokens see exactly the pipeline's
text tokens.
"""
from __future__ import annotations

from typing import Union

import torch

from .base import IMAGE_SIZE
from flowrl.options import Guidance

from .common import Resolution, Schedule, Shift
from .facts import ModelConfigs
from .qwen_family import (QWEN_IMAGE_20B, QWEN_IMAGE_VAE, QWEN_TEXT_ENCODERS, QwenFamilyPolicy, QwenTextTokens,
                          tiny_qwen_components)
from .tiny import build_qwen_tokenizer


class QwenImagePolicy(QwenFamilyPolicy):
    """``FlowPolicy`` for Qwen-Image (see module doc).

    Args:
        pipe: a loaded ``QwenImagePipeline`` (its components are used, not its loop).
        guidance_scale: the pipeline's ``true_cfg_scale``: real CFG against ``negative_prompt``
            with the norm rescale; 1.0 = off (one pass). The pipeline's default is 4.0.
        negative_prompt: the unconditional prompt (the pipeline enables CFG only when one is
            given; Flow-GRPO uses ``" "``).
        max_sequence_length: text tokens kept after the template (the pipeline's default 512; at most 1024).
        shift: None (default) = the pipeline's own schedule (module doc); a float replaces it by
            ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels, int or (H, W); None = ``flowrl.json``'s, else the
            pipeline's default (``default_sample_size * vae_scale_factor`` = 1024).
        device: where the models and all returned tensors live.
    """

    kind = "qwen-image"
    pipeline_class = "QwenImagePipeline"
    tiny_kinds = ("qwen-image",)
    example_hub_id = "Qwen/Qwen-Image"
    published = {example_hub_id: ModelConfigs(QWEN_IMAGE_20B, QWEN_TEXT_ENCODERS, QWEN_IMAGE_VAE, example_hub_id,
                                              "Qwen-Image", "qwen-image-arch")}

    def __init__(self, pipe, *, guidance_scale: Guidance = 4.0, negative_prompt: str = " ",
                 max_sequence_length: QwenTextTokens = 512, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        self._setup_qwen(pipe, guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                         resolution=resolution, device=device)

    @classmethod
    def tiny_components(cls, kind: str = "qwen-image", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``QwenImagePipeline`` (``qwen_family.tiny_qwen_components`` over ``build_qwen_tokenizer``:
        2-layer transformer, width-8 video VAE, 2-layer Qwen2.5-VL, Qwen-Image's scheduler config)."""
        return tiny_qwen_components(build_qwen_tokenizer(), seed)

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: Qwen2.5-VL ``prompt_embeds`` [B, max_sequence_length, D] (zero
        padded) and ``prompt_embeds_mask`` [B, max_sequence_length] (1 = token); with guidance also
        the cached ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``."""
        return super().encode_prompts(prompts)


__all__ = ["QwenImagePolicy"]
