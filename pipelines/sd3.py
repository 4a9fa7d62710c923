"""Stable Diffusion 3 / 3.5 as a ``FlowPolicy``, over diffusers ``StableDiffusion3Pipeline`` components.

Latents are the VAE's ``[B, 16, H/8, W/8]``; the MMDiT (``SD3Transformer2DModel``) is the
trainable part, the three text encoders and the VAE are frozen. Guidance is classifier-free
(one doubled batch, uncond first, as the pipeline does; see ``SD3Policy.velocity`` for training).
The model's time input is ``timestep = sigma * 1000`` (the pipeline passes ``scheduler.timesteps``,
which are that).
"""
from __future__ import annotations

from typing import Union

import torch

from flowrl.options import Guidance

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, Schedule, Shift, TextTokens, resolve_resolution
from .components import CLIP_L, SD3_VAE, T5_XXL
from .facts import Component, ModelConfigs
from .mmdit import SD3TransformerFacts

# Flow-GRPO's LoRA targets for SD3.5 (scripts/train_sd3.py: r=32, alpha=64, gaussian init): every
# projection of the joint attention, image stream (to_*) and text stream (add_*_proj, to_add_out).
SD3_LORA_TARGET_MODULES = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)

__all__ = ["SD3_LORA_TARGET_MODULES", "SD3Policy"]

CLIP_TOKENS = 77  # SD3's prompt embeddings: 77 CLIP tokens, then the T5 tokens

# Published configs (each repository's */config.json; flowrl plan and bench precision build the models from
# them on the meta device or with random weights, no download).
# stabilityai/stable-diffusion-3.5-medium text_encoder_2/config.json (CLIPTextModelWithProjection, OpenCLIP bigG text)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
# stabilityai/stable-diffusion-3.5-medium, transformer/config.json: 24 MMDiT-X blocks, the first 13 with a
# second (image-only) attention
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# stabilityai/stable-diffusion-3.5-large, transformer/config.json: 38 blocks, 38 heads of 64 (2432 wide)
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                  attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                  caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                  qk_norm="rms_norm")
_SD3_TEXT_ENCODERS = {"text_encoder": Component("transformers:CLIPTextModelWithProjection", CLIP_L),
                      "text_encoder_2": Component("transformers:CLIPTextModelWithProjection", CLIP_G),
                      "text_encoder_3": Component("transformers:T5EncoderModel", T5_XXL)}


def _published(hub_id: str, transformer: dict, title: str, arch: str) -> ModelConfigs:
    return ModelConfigs(transformer, _SD3_TEXT_ENCODERS, Component("diffusers:AutoencoderKL", SD3_VAE), hub_id,
                        title, arch)


class SD3Policy(SD3TransformerFacts, DiffusersPolicy):
    """``FlowPolicy`` for SD3 / SD3.5 (see module doc).

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline`` (its components are used, not its loop).
        guidance_scale: CFG scale; 1.0 = no guidance (single pass). Flow-GRPO samples SD3.5-M at 4.5.
        negative_prompt: the unconditional prompt for CFG.
        max_sequence_length: T5 tokens (the pipeline's default 256; Flow-GRPO uses 128).
        shift: the static timestep shift; None takes ``scheduler.config.shift`` (3.0 for SD3.x).
        schedule: ``"diffusers"`` (the pipeline's own sigmas) or ``"linear"`` (docs/algorithms.md §1).
        resolution: image size in pixels, int or (H, W); None = the pipeline's default
            (``transformer.config.sample_size * vae_scale_factor``, 1024 for SD3.5-M).
        device: where the models and all returned tensors live.
    """

    kind = "sd3"
    pipeline_class = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    lora_target_modules = SD3_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tiny_kinds = ("sd3",)
    example_hub_id = "stabilityai/stable-diffusion-3.5-medium"
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")  # _forward(x, sigma, *these) (base velocity)
    published = {m.source: m for m in (
        _published("stabilityai/stable-diffusion-3.5-medium", SD35_MEDIUM, "SD3.5-Medium", "sd35m-arch"),
        _published("stabilityai/stable-diffusion-3.5-large", SD35_LARGE, "SD3.5-Large", "sd35l-arch"))}

    def __init__(self, pipe, *, guidance_scale: Guidance = 4.5, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 256, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        sched_cfg = pipe.scheduler.config
        if shift is None:
            if sched_cfg.get("use_dynamic_shifting", False):
                raise ValueError("this SD3 scheduler uses dynamic shifting; pass an explicit static shift= "
                                 "(flowrl's SD3 schedule is the static-shift one)")
            shift = float(sched_cfg.get("shift", 1.0))
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=float(shift), schedule=schedule)
        self._setup(pipe, device)  # frozen VAE / text encoders, vae_scale_factor, LoRA targets, negative cache
        self.patch_size = int(self.transformer.config.patch_size)
        default_size = int(self.transformer.config.sample_size) * self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, default_size, self.vae_scale_factor * self.patch_size)
        self.latent_shape = (int(self.transformer.config.in_channels),
                             self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)  # (C, h, w)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def text_tokens(cls, options: dict) -> int:
        """77 CLIP tokens, then ``max_sequence_length`` T5 tokens (default 256)."""
        return CLIP_TOKENS + super().text_tokens(options)

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """``timestep = sigma * 1000`` (the pipeline's ``scheduler.timesteps``); latents ``[B, C, h, w]``."""
        return dict(hidden_states=x.to(dtype), timestep=sigma * 1000.0,
                    encoder_hidden_states=cond["prompt_embeds"].to(x.device, dtype),  # [B, 77 + L, D]
                    pooled_projections=cond["pooled_prompt_embeds"].to(x.device, dtype),  # [B, P]
                    return_dict=False)

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        cfg = dict(sample_size=32, patch_size=2, in_channels=transformer["in_channels"],
                   out_channels=transformer["out_channels"], num_layers=2, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=64,
                   qk_norm=transformer.get("qk_norm"))
        return {**cfg, "dual_attention_layers": (0,)} if transformer.get("dual_attention_layers") else cfg

    @classmethod
    def tiny_components(cls, kind: str = "sd3", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``StableDiffusion3Pipeline`` (SD3.5-style qk RMSNorm, one dual-attention layer):
        sizes as diffusers' own fast tests, real (truncated) CLIP / T5 tokenizers; see ``pipelines/tiny.py``."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection

        from .tiny import LATENT_CHANNELS, build_clip_tokenizer, build_t5_tokenizer, clip_config, kl_vae, t5_encoder

        tok = build_clip_tokenizer()
        tok3 = build_t5_tokenizer(model_max_length=512)
        eos, bos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|startoftext|>")
        clip_hidden, t5_dim = 32, 64  # clip prompt embeds: 32 + 32 = 64 wide, padded to the T5 width
        torch.manual_seed(seed)
        te1 = CLIPTextModelWithProjection(clip_config(len(tok), eos, bos, clip_hidden, 32))
        torch.manual_seed(seed + 1)
        te2 = CLIPTextModelWithProjection(clip_config(len(tok), eos, bos, clip_hidden, 32))
        torch.manual_seed(seed + 2)
        te3 = t5_encoder(len(tok3), t5_dim)
        torch.manual_seed(seed + 3)
        transformer = SD3Transformer2DModel(
            sample_size=image_size // 8, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_layers=2, attention_head_dim=8, num_attention_heads=4, joint_attention_dim=t5_dim,
            caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm")
        torch.manual_seed(seed + 4)
        vae = kl_vae(1.5305, 0.0609, image_size)  # SD3's VAE scaling / shift factors
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3 / SD3.5 config
        return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=tok,
                    text_encoder_2=te2, tokenizer_2=build_clip_tokenizer(), text_encoder_3=te3, tokenizer_3=tok3,
                    image_encoder=None, feature_extractor=None)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        pe, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return pe, pooled  # [B, 77 + L_t5, D], [B, P]

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text conditioning, batch-first: ``prompt_embeds`` [B, 77 + max_sequence_length, D] (CLIP-L +
        CLIP-G hidden states padded to the T5 width, then T5) and ``pooled_prompt_embeds`` [B, P];
        with guidance also ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds`` (the
        negative prompt, encoded once and cached)."""
        return super().encode_prompts(prompts)
