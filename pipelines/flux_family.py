"""The FLUX.1 family's ``FlowPolicy`` base: what FLUX.1 [dev] / [schnell] (``pipelines/flux.py``) and FLUX.1
Kontext (``pipelines/flux_kontext.py``) share over their diffusers pipelines' components.

The policy exposes **unpacked, image-shaped latents** ``[B, 16, h, w]`` (``h = H/8``), so step
functions and stored transitions look the same as for SD3; ``velocity`` packs them into the
transformer's 2x2-patch token sequence ``[B, (h/2)(w/2), 64]`` and unpacks the prediction
(the logic of ``FluxPipeline._pack_latents`` / ``_unpack_latents``).

Guidance: FLUX.1-dev is guidance-distilled, ``guidance_scale`` (default 3.5) enters as an
embedding (``transformer.config.guidance_embeds``), one forward pass; schnell has none.
``true_cfg_scale > 1`` adds real classifier-free guidance against ``negative_prompt`` (a
doubled batch), as the pipeline's ``true_cfg_scale`` does. The transformer's time input is
sigma itself (the pipeline passes ``timestep / 1000``; the model multiplies by 1000 inside).
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch

from flowrl.options import Guidance, NonNegativeFloat
from flowrl.schedules import flux_sigmas, shift_sigmas

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, Schedule, Shift, TextTokens, check_scheduler, resolve_resolution
from .components import CLIP_L, FLUX_VAE, T5_XXL
from .facts import Component, ModelConfigs
from .mmdit import DoubleSingleStreamFacts
from .packing import PackedLatents, latent_image_ids, pack_latents

# Flow-GRPO's LoRA targets for FLUX (scripts/train_flux.py: r=64, alpha=128, gaussian init): the
# joint-attention projections of both streams plus both streams' feed-forwards. (As peft suffix
# patterns, attn.to_q/k/v also match the single-stream blocks' projections.)
FLUX_LORA_TARGET_MODULES = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)

# Published configs (the repository's */config.json): black-forest-labs/FLUX.1-dev transformer/config.json (19 double
# + 38 single blocks, 24 heads of 128); text_encoder and text_encoder_2 are SD3's CLIP-L tower (as a CLIPTextModel)
# and T5-XXL encoder; vae/config.json is SD3's AutoencoderKL layout with FLUX's scaling / shift factors (all three in
# pipelines/components.py)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
FLUX1_DEV = ModelConfigs(
    FLUX_DEV, {"text_encoder": Component("transformers:CLIPTextModel", CLIP_L),
               "text_encoder_2": Component("transformers:T5EncoderModel", T5_XXL)},
    Component("diffusers:AutoencoderKL", FLUX_VAE), "black-forest-labs/FLUX.1-dev", "FLUX.1-dev", "flux-arch")


class FluxFamilyPolicy(DoubleSingleStreamFacts, PackedLatents, DiffusersPolicy):
    """``FlowPolicy`` base of FLUX.1 and FLUX.1 Kontext (see module doc); an adapter adds its
    declarations (``kind``, ``pipeline_class``, ``tiny_kinds``, ``published``, ...).

    Args:
        pipe: a loaded ``FluxPipeline`` (its components are used, not its loop).
        guidance_scale: embedded guidance for guidance-distilled models (dev: 3.5); ignored when
            ``transformer.config.guidance_embeds`` is False (schnell).
        true_cfg_scale: real CFG scale against ``negative_prompt``; 1.0 = off (the default, as FLUX).
        max_sequence_length: T5 tokens (the pipeline's default 512; Flow-GRPO uses 128).
        shift: None (default) = the pipeline's own schedule: ``linspace(1, 1/T, T)`` shifted
            dynamically by image size (dev: ``use_dynamic_shifting``) or statically by
            ``scheduler.config.shift`` (schnell). A float overrides it with
            ``flow_sigmas(T, shift, schedule)`` (DanceGRPO / BranchGRPO use ``"linear"``, shift 3).
        resolution: image size in pixels, int or (H, W); None = ``flowrl.json``'s, else the
            pipeline's default 1024.
        device: where the models and all returned tensors live.
    """

    transformer_class = "FluxTransformer2DModel"
    lora_target_modules = FLUX_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder", "text_encoder_2")
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")  # _forward(x, sigma, *these) (base velocity)

    def __init__(self, pipe, *, guidance_scale: NonNegativeFloat = 3.5, true_cfg_scale: Guidance = 1.0,
                 negative_prompt: str = "", max_sequence_length: TextTokens = 512, shift: Shift = None,
                 schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                           true_cfg_scale=float(true_cfg_scale))
        check_scheduler(type(self).__name__, pipe.scheduler.config, shift, schedule)
        self._setup(pipe, device)  # frozen VAE / text encoders, vae_scale_factor, LoRA targets, negative cache
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.height, self.width = resolve_resolution(resolution, 128 * self.vae_scale_factor, self.vae_scale_factor * 2)
        h, w = 2 * (self.height // (self.vae_scale_factor * 2)), 2 * (self.width // (self.vae_scale_factor * 2))
        self.latent_shape = (int(self.transformer.config.in_channels) // 4, h, w)  # (C, h, w), unpacked
        self.image_seq_len = (h // 2) * (w // 2)  # packed tokens per image

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def cfg_rows(cls, guidance_scale: float, options: dict) -> int:
        """Embedded guidance is one pass; ``true_cfg_scale > 1`` doubles the batch."""
        return 2 if float(options.get("true_cfg_scale", 1.0)) > 1.0 else 1

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, guidance_scale: float = 3.5, **settings) -> dict:
        """Unpacked latents ``[B, C, h, w]`` packed to ``[B, (h/2)(w/2), 4C]`` with their position ids,
        zero text ids, ``timestep = sigma``, the embedded ``guidance_scale`` when the model has one."""
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"FLUX latents need even height and width (2x2 packing), got {tuple(x.shape)}")
        pe = cond["prompt_embeds"]
        guidance = (torch.full((b,), guidance_scale, dtype=torch.float32, device=x.device)
                    if config.get("guidance_embeds") else None)  # [B]
        return dict(hidden_states=pack_latents(x).to(dtype), timestep=sigma, guidance=guidance,
                    pooled_projections=cond["pooled_prompt_embeds"].to(x.device, dtype),  # [B, P]
                    encoder_hidden_states=pe.to(x.device, dtype),  # [B, L, D]
                    txt_ids=torch.zeros(pe.shape[1], 3, device=x.device, dtype=dtype),  # [L, 3]
                    img_ids=latent_image_ids(h, w, x.device, dtype), return_dict=False)  # [(h/2)(w/2), 3]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return dict(patch_size=1, in_channels=transformer["in_channels"], num_layers=1, num_single_layers=1,
                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                    guidance_embeds=transformer.get("guidance_embeds", False), axes_dims_rope=(4, 6, 6))

    @classmethod
    def tiny_components(cls, kind: str = "flux", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``FluxPipeline``: ``"flux"`` is FLUX.1-dev-like (guidance embedding, dynamic shift),
        ``"flux-schnell"`` schnell-like (no guidance embedding, static shift 1); see ``pipelines/tiny.py``."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextModel

        from .tiny import LATENT_CHANNELS, build_clip_tokenizer, build_t5_tokenizer, clip_config, kl_vae, t5_encoder

        guidance_embeds = kind == "flux"
        tok = build_clip_tokenizer()
        tok2 = build_t5_tokenizer(model_max_length=512)
        eos, bos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|startoftext|>")
        torch.manual_seed(seed)
        te1 = CLIPTextModel(clip_config(len(tok), eos, bos, 32, 32))
        torch.manual_seed(seed + 1)
        te2 = t5_encoder(len(tok2), 32)
        torch.manual_seed(seed + 2)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=LATENT_CHANNELS * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 4, 8))
        torch.manual_seed(seed + 3)
        vae = kl_vae(0.3611, 0.1159, image_size)  # FLUX's VAE scaling / shift factors
        common = dict(num_train_timesteps=1000, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                      max_image_seq_len=4096)
        if guidance_embeds:  # FLUX.1-dev scheduler config
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, **common)
        else:  # FLUX.1-schnell scheduler config
            scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False, **common)
        return dict(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=tok,
                    text_encoder_2=te2, tokenizer_2=tok2, image_encoder=None, feature_extractor=None)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        pe, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                num_images_per_prompt=1,
                                                max_sequence_length=self.max_sequence_length)
        return pe, pooled  # [B, L, D] T5 hidden states, [B, P] CLIP pooled

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: ``prompt_embeds`` [B, max_sequence_length, D] (T5) and
        ``pooled_prompt_embeds`` [B, P] (CLIP); with ``true_cfg_scale > 1`` also the cached
        ``negative_*`` ones. (Text position ids are all zero and rebuilt in ``velocity``.)"""
        return super().encode_prompts(prompts)

    @property
    def cfg_scale(self) -> float:
        return self.true_cfg_scale

    def forward_settings(self) -> dict:
        return {"guidance_scale": self.guidance_scale}

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly what ``FluxPipeline`` gives its scheduler at this resolution (see class doc)."""
        cfg = self.pipe.scheduler.config
        if cfg.get("use_dynamic_shifting", False):
            return flux_sigmas(num_steps, self.image_seq_len, base_seq_len=cfg.get("base_image_seq_len", 256),
                               max_seq_len=cfg.get("max_image_seq_len", 4096), base_shift=cfg.get("base_shift", 0.5),
                               max_shift=cfg.get("max_shift", 1.15))
        s = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)  # the pipeline's default sigmas
        s = torch.from_numpy(shift_sigmas(s, float(cfg.get("shift", 1.0))).astype(np.float32))
        return torch.cat([s, torch.zeros(1)])


__all__ = ["FLUX1_DEV", "FLUX_DEV", "FLUX_LORA_TARGET_MODULES", "FluxFamilyPolicy"]
