"""Krea 2 (Krea AI 2026; a 12B single-stream MMDiT) as a ``FlowPolicy``, over diffusers ``Krea2Pipeline`` components.

**Latents.** The policy's latents are Qwen-Image's VAE latents ``[B, 16, h, w]`` (``h = H / 8``;
``AutoencoderKLQwenImage``, Wan2.1's layout); ``velocity`` packs them into 2x2-patch tokens ``[B, (h/2)(w/2), 64]``
(``Krea2Pipeline._pack_latents``: the layout of ``pipelines/packing.py``) and unpacks the prediction, a velocity.
Resolutions are multiples of 16 pixels.

**Text.** The pipeline's own ``encode_prompt``: Qwen-Image's chat template tokenized as a fixed-length block
(``[system prefix | prompt | padding | assistant suffix]``, ``max_sequence_length`` tokens after the 34-token prefix
is dropped), Qwen3-VL-4B's hidden states of twelve layers stacked per token (``[B, L, 12, 2560]``) with a boolean
mask (padding does not advance the text positions). The transformer fuses the layers itself (its text-fusion
stage) and attends to the text with that mask as a key mask; every row has the same ``L`` tokens and text tokens
sit at RoPE position 0, so a row's velocity does not depend on its batch-mates.

**Time and schedule.** The time input is the pipeline's ``(1000 sigma) / 1000``. The schedule is
``linspace(1, 1/T, T)`` through the pipeline's scheduler with ``mu`` from the packed token count (the pipeline's
``calculate_shift``, ``max_image_seq_len`` falling back to Krea's 6400), or the fixed ``mu = 1.15`` of a
step-distilled pipeline (``is_distilled``: Krea-2-Turbo).

**Guidance.** Krea 2's convention is ``c + g (c - u)`` against ``negative_prompt`` (the pipeline's ``""``), on when
``g > 0``: flowrl's ``guidance_scale`` is the usual CFG scale ``s`` of ``u + s (c - u)`` (1.0 = none, as for every
model), so **s = g + 1**: the pipeline's default g = 4.5 is s = 5.5, Krea-2-Turbo's g = 0 is s = 1.0 (one pass). With
CFG both halves run in one doubled batch.

**Decoding.** ``latents / (1 / latents_std) + latents_mean`` per channel, the VAE on one frame, ``x / 2 + 0.5``
clamped (:func:`pipelines.video.video_vae_decode`, as the pipeline decodes).
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch

from flowrl.options import Guidance

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, Schedule, Shift, TextTokens, scheduler_sigmas
from .facts import Component, ModelConfigs
from .packing import PackedLatents, latent_image_ids, pack_latents
from .qwen_family import QWEN_IMAGE_VAE, QwenVideoVaeFacts, tiny_qwen3_vl
from .tiny import build_qwen_tokenizer
from .video import video_vae_decode

# Published configs (the repositories' */config.json; flowrl plan and bench precision build the models from them,
# no download). krea/Krea-2-Raw and krea/Krea-2-Turbo transformer/config.json (Krea2Transformer2DModel; RAW and Turbo
# share the architecture): 28 blocks of 48 query / 12 KV heads of 128 (6144 wide), SwiGLU 16384, 64 packed channels,
# RoPE (32, 48, 48) at theta 1000, text fusion over 12 tapped Qwen3-VL-4B layers of 2560 (2 layer-wise + 2 refiner
# blocks of 20 heads, SwiGLU 6912): diffusers' Krea2Transformer2DModel defaults, which are the authors' own config
# (krea-ai/krea-2 src/krea2/inference/bf16.py single_mmdit_large_wide: features 6144, heads 48, kvheads 12,
# multiplier 4, layers 28, patch 2, channels 16, txtdim 2560, txtheads 20, txtlayers 12)
KREA2_12B = dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
                 intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560, num_text_layers=12,
                 text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=6912,
                 num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48), rope_theta=1000.0,
                 norm_eps=1e-5)
# text_encoder/config.json: Qwen/Qwen3-VL-4B-Instruct as Qwen3VLModel (no output head; the authors' TextEncoderConfig
# model_id): 36 layers 2560 wide, 32 query / 8 KV heads of 128, interleaved M-RoPE [24, 20, 20] at theta 5e6; a
# 24-block vision tower 1024 wide with DeepStack taps 5 / 11 / 17 (as third-party readers of the repositories copy it)
QWEN3_VL_4B = dict(
    text_config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                     max_position_embeddings=262144, rms_norm_eps=1e-6, attention_bias=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                      "mrope_interleaved": True}),
    vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304, out_hidden_size=2560,
                       deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True)
# scheduler/scheduler_config.json: the dynamic exponential shift Krea2Pipeline's docstring asks for (base_shift 0.5,
# max_shift 1.15 over 256 -> 6400 tokens: the authors' sampler's y1 / y2 between 256 and 1280 px at 16 px per token);
# no copy of the repositories' file was found
KREA2_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                       base_image_seq_len=256, max_image_seq_len=6400, time_shift_type="exponential")
DISTILLED_MU = 1.15  # Krea2Pipeline's fixed mu of the step-distilled (Turbo) checkpoint

# The Krea 2 authors' suggestion for long LoRA runs (diffusers' examples/dreambooth/README_krea2.md,
# train_dreambooth_lora_krea2.py): the attention layers, to_q / to_k / to_v / to_out.0 and the output gate (as
# suffixes: the text-fusion blocks' attention too, as their script matches them)
KREA2_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "to_gate")


def _published(name: str) -> ModelConfigs:
    hub_id = f"krea/{name}"
    return ModelConfigs(KREA2_12B, {"text_encoder": Component("transformers:Qwen3VLModel", QWEN3_VL_4B)},
                        QWEN_IMAGE_VAE, hub_id, name, "krea2-arch")  # "the Qwen-Image VAE" (Krea2Pipeline)


class Krea2Policy(QwenVideoVaeFacts, PackedLatents, DiffusersPolicy):
    """``FlowPolicy`` for Krea 2 (see module doc).

    Args:
        pipe: a loaded ``Krea2Pipeline`` (its components are used, not its loop).
        guidance_scale: the CFG scale s of ``u + s (c - u)``, 1.0 = none (one pass; Krea-2-Turbo's setting); the
            pipeline's ``guidance_scale`` is s - 1 (its default 4.5 is s = 5.5, the default here).
        negative_prompt: the unconditional prompt (the pipeline's default ``""``).
        max_sequence_length: the fixed text length after the template prefix (the pipeline's default 512).
        shift: None (default) = the pipeline's schedule (module doc); a float replaces it by
            ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels, int or (H, W), multiples of 16; None = ``flowrl.json``'s, else the
            pipeline's 1024.
        device: where the models and all returned tensors live.
    """

    kind = "krea2"
    pipeline_class = "Krea2Pipeline"
    transformer_class = "Krea2Transformer2DModel"
    lora_target_modules = KREA2_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    tiny_kinds = ("krea2",)
    example_hub_id = "krea/Krea-2-Raw"
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")  # _forward(x, sigma, *these) (base velocity)
    # the step-distilled Turbo, then the base RAW (for training), which, last, titles krea2-arch
    published = {m.source: m for m in (_published("Krea-2-Turbo"), _published("Krea-2-Raw"))}

    def __init__(self, pipe, *, guidance_scale: Guidance = 5.5, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 512, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        # guidance_scale >= 1.0: 1.0 = no guidance (the pipeline's guidance_scale g is flowrl's s - 1)
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule)
        if pipe.scheduler.config.get("invert_sigmas") and shift is None:
            raise ValueError("Krea2Policy's schedule runs from 1 to 0; this scheduler inverts its sigmas "
                             "(invert_sigmas=True): pass shift= to use flowrl's static-shift schedule instead")
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor, LoRA targets, negative cache
        self.distilled = bool(pipe.config.get("is_distilled", False))
        self._image_geometry(resolution, 1024, int(self.transformer.config.in_channels) // 4)  # unpacked latents

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """The stacked Qwen3-VL layers ``[rows, L, num_text_layers, text_hidden_dim]`` and their bool mask
        ``[rows, L]``."""
        c = configs.transformer
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, c["num_text_layers"], c["text_hidden_dim"],
                                             device=device, dtype=dtype),  # [B, L, K, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.bool)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Unpacked latents ``[B, C, h, w]`` packed to ``[B, (h/2)(w/2), 4C]``, the stacked text ``[B, L, K, D]`` with
        its key mask (meta tensors, the planner's shapes: unmasked, as a fused kernel's memory), the ``(t, h, w)``
        RoPE coordinates ``[L + (h/2)(w/2), 3]`` (text at 0, image ``(0, row, col)``), time ``(1000 sigma) / 1000``."""
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"Krea 2 latents need even height and width (2x2 packing), got {tuple(x.shape)}")
        pe, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]  # [B, L, K, D], [B, L]
        text_ids = torch.zeros(pe.shape[1], 3, device=x.device)  # [L, 3]
        ids = torch.cat([text_ids, latent_image_ids(h, w, x.device)])  # [L + (h/2)(w/2), 3]
        return dict(hidden_states=pack_latents(x).to(dtype), encoder_hidden_states=pe.to(x.device, dtype),
                    timestep=sigma * 1000.0 / 1000.0, position_ids=ids,
                    encoder_attention_mask=None if mask.device.type == "meta" else mask.to(x.device, torch.bool),
                    return_dict=False)  # hidden_states [B, (h/2)(w/2), 4C]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                "num_key_value_heads": 1, "intermediate_size": 32, "timestep_embed_dim": 32, "text_hidden_dim": 16,
                "text_num_attention_heads": 2, "text_num_key_value_heads": 2, "text_intermediate_size": 32,
                "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1, "axes_dims_rope": (4, 6, 6)}

    @classmethod
    def tiny_components(cls, kind: str = "krea2", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``Krea2Pipeline`` (RAW's layout): the published transformer shrunk (:meth:`shrink_config`: 2 blocks of
        2 query / 1 KV heads of 16, the RoPE split the authors' formula gives a head of 16, one layer-wise and one
        refiner text-fusion block over the 12 published taps), a 36-layer ``Qwen3VLModel`` 16 wide (the pipeline taps
        layers 2, 5, ..., 35) over ``build_qwen_tokenizer`` (Qwen-Image's template prefix is 34 tokens on it, as the
        pipeline drops), Qwen-Image's VAE layout at width 8 (its latent mean / std) and the published scheduler."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel

        tok = build_qwen_tokenizer()
        torch.manual_seed(seed)
        text_encoder = tiny_qwen3_vl("Qwen3VLModel", tok, 36, tie_word_embeddings=True)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])  # default latents_mean / std
        torch.manual_seed(seed + 2)
        transformer = Krea2Transformer2DModel(**cls.shrink_config(KREA2_12B))
        return dict(scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER), vae=vae, text_encoder=text_encoder,
                    tokenizer=tok, transformer=transformer, is_distilled=False)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, mask = self.pipe.encode_prompt(list(prompts), device=self.device,
                                           max_sequence_length=self.max_sequence_length)  # [B, L, K, D], [B, L]
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask}

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: ``prompt_embeds`` [B, max_sequence_length, 12, D] (twelve Qwen3-VL layers per
        token) and the bool ``prompt_embeds_mask`` [B, max_sequence_length]; with CFG also the cached
        ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``."""
        return super().encode_prompts(prompts)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas ``Krea2Pipeline`` gives its scheduler for ``num_steps`` steps at this resolution
        (module doc)."""
        from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

        cfg = self.pipe.scheduler.config
        mu = DISTILLED_MU if self.distilled else calculate_shift(
            self.image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 6400),
            cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        return scheduler_sigmas(self.pipe.scheduler, np.linspace(1.0, 1 / num_steps, num_steps), mu)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 16, h, w]`` -> float32 images ``[B, 3, 8h, 8w]`` in [0, 1] through the video VAE with one
        frame (module doc); ``decode_batch`` images per VAE call."""
        video = video_vae_decode(self.vae, self.vae_latents(latents), self.device, self.decode_batch)  # [B, 3, 1, H, W]
        return video[:, :, 0]  # [B, 3, H, W]


__all__ = ["KREA2_12B", "KREA2_LORA_TARGET_MODULES", "KREA2_SCHEDULER", "Krea2Policy", "QWEN3_VL_4B"]
