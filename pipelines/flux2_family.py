"""The FLUX.2 family's ``FlowPolicy`` base: what FLUX.2 [dev] (``pipelines/flux2.py``: ``Flux2Pipeline``, a
Mistral Small 3.2 text encoder, embedded guidance) and FLUX.2 [klein] (``pipelines/flux2_klein.py``:
``Flux2KleinPipeline``, a Qwen3 text encoder, real CFG) share over their diffusers pipelines' components
(Black Forest Labs 2025, github.com/black-forest-labs/flux2).

**Latents.** The policy's latents are unpacked and image-shaped, ``[B, 32, h, w]`` (``h = H / 8``, the
32 channels of ``AutoencoderKLFlux2``); ``velocity`` packs them into 2x2-patch tokens ``[B, (h/2)(w/2),
128]`` (FLUX.2's ``_patchify_latents`` then ``_pack_latents``: the layout of ``pipelines/packing.py``)
with 4-axis RoPE ids ``(t, h, w, l)``: image tokens ``(0, row, col, 0)``, text tokens ``(0, 0, 0, l)``
(the pipelines' ``_prepare_latent_ids`` / ``_prepare_text_ids``). They live in FLUX.2's normalized space:
the VAE's batch-norm running statistics over the 128 patchified channels; ``decode`` patchifies,
applies ``z sqrt(var + eps) + mean``, unpatchifies and decodes, as the pipelines do. The pipelines draw
their initial noise in the packed layout; flowrl draws it in its own (a permutation: the same
distribution), and the parity tests hand the pipeline flowrl's noise packed.

**Text.** The pipeline's own ``encode_prompt``: its chat template, padded (and truncated) to
``max_sequence_length`` tokens, the text encoder's hidden states of three layers stacked per token
(``[B, L, 3 D]``). The transformer attends to all ``L`` tokens, padding included, with no mask, as the
pipelines run it.

**Time and schedule.** The time input is sigma (the pipelines pass ``t / 1000`` with ``t = 1000 sigma``;
the transformer multiplies by 1000). The schedule is ``linspace(1, 1/T, T)`` through the pipeline's
scheduler with FLUX.2's empirical ``mu = compute_empirical_mu(image_seq_len, T)`` (black-forest-labs/flux2
``sampling.py``): it depends on the step count as well as the resolution.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from flowrl.options import NonNegativeFloat

from .base import DiffusersPolicy
from .common import (DECODE_BATCH, Resolution, Schedule, Shift, TextTokens, check_scheduler, module_dtype,
                     scheduler_sigmas)
from .mmdit import DoubleSingleStreamFacts
from .packing import PackedLatents, pack_latents

# Flow-Factory's default LoRA targets for FLUX.2 and FLUX.2 [klein] (src/flow_factory/models/flux/flux2.py,
# flux2_klein.py; r=64, alpha=128): both streams' attention projections and feed-forwards of the double-stream
# blocks, and the single-stream blocks' fused QKV + MLP input projection.
FLUX2_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)
# black-forest-labs/FLUX.2-dev (and FLUX.2-klein-*) vae/config.json: AutoencoderKLFlux2 as diffusers'
# scripts/convert_flux2_to_diffusers.py builds it (AutoencoderKLFlux2(), its defaults): 32 latent channels,
# factor 8, quant convs, batch-norm statistics over the 2x2-patchified 128 channels
FLUX2_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                 up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
                 act_fn="silu", latent_channels=32, norm_num_groups=32, sample_size=1024, use_quant_conv=True,
                 use_post_quant_conv=True, mid_block_add_attention=True, batch_norm_eps=1e-4,
                 batch_norm_momentum=0.1, patch_size=[2, 2])


def patchify(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, 4C, h/2, w/2]``, channel ``4c + 2dy + dx`` (``Flux2Pipeline._patchify_latents``)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)  # [B, C, 2, 2, h/2, w/2]
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify` (``Flux2Pipeline._unpatchify_latents``): ``[B, 4C, h/2, w/2]`` -> ``[B, C, h, w]``."""
    b, c4, h2, w2 = x.shape
    x = x.reshape(b, c4 // 4, 2, 2, h2, w2).permute(0, 1, 4, 2, 5, 3)  # [B, C, h/2, 2, w/2, 2]
    return x.reshape(b, c4 // 4, h2 * 2, w2 * 2)


def flux2_ids(h2: int, w2: int, text_tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """4-axis RoPE ids ``(t, h, w, l)`` of ``h2 x w2`` packed image tokens ``[h2 w2, 4]`` (``(0, row, col, 0)``,
    row-major) and of ``text_tokens`` text tokens ``[L, 4]`` (``(0, 0, 0, l)``), int64 as the pipelines build them."""
    img = torch.zeros(h2, w2, 4, dtype=torch.int64, device=device)
    img[..., 1] = torch.arange(h2, device=device)[:, None]
    img[..., 2] = torch.arange(w2, device=device)[None, :]
    txt = torch.zeros(text_tokens, 4, dtype=torch.int64, device=device)
    txt[:, 3] = torch.arange(text_tokens, device=device)
    return img.reshape(-1, 4), txt  # [h2 w2, 4], [L, 4]


def flux2_vae_decode(vae, latents: torch.Tensor, device, batch: Optional[int] = DECODE_BATCH) -> torch.Tensor:
    """Normalized latents ``[B, 32, h, w]`` -> float32 images ``[B, 3, 8h, 8w]`` in [0, 1], as the FLUX.2
    pipelines decode: patchify, ``z sqrt(bn.running_var + eps) + bn.running_mean`` per patchified channel,
    unpatchify, VAE decode, ``x / 2 + 0.5`` clamped. ``batch`` images per VAE call (None: all)."""
    dtype = module_dtype(vae)
    step = batch or max(1, len(latents))
    out = []
    for i in range(0, len(latents), step):
        z = patchify(latents[i:i + step].to(device, dtype))  # [b, 128, h/2, w/2]
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        with torch.no_grad():
            img = vae.decode(unpatchify(z * std + mean), return_dict=False)[0]  # [b, 3, H, W] in ~[-1, 1]
        out.append((img.float() / 2 + 0.5).clamp(0, 1))
    return torch.cat(out)  # [B, 3, H, W]


class Flux2FamilyPolicy(DoubleSingleStreamFacts, PackedLatents, DiffusersPolicy):
    """``FlowPolicy`` base of FLUX.2 [dev] and FLUX.2 [klein] (module doc); an adapter adds its
    declarations (``kind``, ``pipeline_class``, ``tiny_kinds``, ``published``, ``cfg_rows``, ...).

    Guidance: a guidance-distilled transformer (``guidance_embeds``: FLUX.2 [dev]) takes
    ``guidance_scale`` as an embedding, one forward pass; otherwise ``guidance_scale > 1`` is real CFG
    against ``negative_prompt`` (one doubled batch; the [klein] pipeline runs two passes), except for a
    step-distilled pipeline (``is_distilled``: FLUX.2-klein-4B / 9B), which ignores it as the pipeline does.

    Args:
        pipe: a loaded FLUX.2 pipeline (its components are used, not its loop).
        guidance_scale: the pipelines' default 4.0 (embedded for [dev], CFG for [klein] base models).
        negative_prompt: the unconditional prompt of real CFG (the [klein] pipeline's is ``""``).
        max_sequence_length: text tokens (padded to it; the pipelines' default 512).
        shift: None (default) = the pipeline's own schedule (module doc); a float replaces it by
            ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels, int or (H, W); None = ``flowrl.json``'s, else the pipelines' 1024.
        device: where the models and all returned tensors live.
    """

    transformer_class = "Flux2Transformer2DModel"
    lora_target_modules = FLUX2_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    cond_keys = ("prompt_embeds",)  # _forward(x, sigma, *these) (base velocity)

    def __init__(self, pipe, *, guidance_scale: NonNegativeFloat = 4.0, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 512, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule)
        check_scheduler(type(self).__name__, pipe.scheduler.config, shift, schedule, dynamic=True)
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor, LoRA targets, negative cache
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.distilled = bool(pipe.config.get("is_distilled", False))
        self._image_geometry(resolution, int(pipe.default_sample_size) * self.vae_scale_factor,
                             int(self.transformer.config.in_channels) // 4)  # unpacked latents

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """The stacked text features ``[rows, L, joint_attention_dim]`` (no mask: the transformer sees all L)."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["joint_attention_dim"],
                                             device=device, dtype=dtype)}  # [B, L, D]

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, guidance_scale: float = 4.0, **settings) -> dict:
        """Unpacked latents ``[B, C, h, w]`` packed to ``[B, (h/2)(w/2), 4C]``, the text ``[B, L, D]`` unmasked,
        their 4-axis ids, ``timestep`` = the pipelines' ``(1000 sigma) / 1000``, and the embedded
        ``guidance_scale`` when the transformer has a guidance embedding."""
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"FLUX.2 latents need even height and width (2x2 packing), got {tuple(x.shape)}")
        pe = cond["prompt_embeds"]  # [B, L, D]
        img_ids, txt_ids = flux2_ids(h // 2, w // 2, pe.shape[1], x.device)
        guidance = (torch.full((b,), guidance_scale, dtype=torch.float32, device=x.device)
                    if config.get("guidance_embeds") else None)  # [B]
        return dict(hidden_states=pack_latents(x).to(dtype), encoder_hidden_states=pe.to(x.device, dtype),
                    timestep=sigma * 1000.0 / 1000.0, guidance=guidance,
                    img_ids=img_ids[None], txt_ids=txt_ids[None],  # [1, L, 4]: as the model's _cp_plan splits them
                    return_dict=False)  # hidden_states [B, (h/2)(w/2), 4C]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return dict(patch_size=1, in_channels=transformer["in_channels"], num_layers=1, num_single_layers=1,
                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
                    mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=transformer.get("guidance_embeds", True))

    @classmethod
    def tiny_parts(cls, image_size: int, seed: int, joint_attention_dim: int, guidance_embeds: bool) -> dict:
        """The tiny transformer, VAE and scheduler of a FLUX.2 pipeline (the adapter adds its text encoder):
        a 1 + 1 block ``Flux2Transformer2DModel`` (128 packed channels, 4-axis RoPE, as the real model), an
        ``AutoencoderKLFlux2`` with FLUX.2's layout (32 latent channels, factor 8, quant convs) at width 8
        whose batch-norm statistics are random (so decoding checks the denormalization), and FLUX.1-dev's
        scheduler config, which the FLUX.2 repositories ship (dynamic exponential shift)."""
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        torch.manual_seed(seed)
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=joint_attention_dim, timestep_guidance_channels=32,
            mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=32,
                                 norm_num_groups=4, sample_size=image_size)
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=g))
            vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(vae.bn.running_var.shape, generator=g))
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                    base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                    max_image_seq_len=4096)
        return dict(transformer=transformer, vae=vae, scheduler=scheduler)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, _ = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": pe}  # [B, L, 3 D]; the text ids are rebuilt in transformer_inputs

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: ``prompt_embeds`` [B, max_sequence_length, 3 D] (three hidden layers of
        the text encoder per token); with real CFG also the cached ``negative_prompt_embeds``."""
        return super().encode_prompts(prompts)

    @property
    def cfg_scale(self) -> float:
        """Real CFG scale: 1.0 for an embedded guidance (FLUX.2 [dev]) or a step-distilled pipeline."""
        return 1.0 if self.guidance_embeds or self.distilled else self.guidance_scale

    def forward_settings(self) -> dict:
        return {"guidance_scale": self.guidance_scale}

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas the FLUX.2 pipelines give their scheduler for ``num_steps`` steps at this
        resolution (module doc)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return scheduler_sigmas(self.pipe.scheduler, np.linspace(1.0, 1 / num_steps, num_steps),
                                compute_empirical_mu(self.image_seq_len, num_steps))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 32, h, w]`` -> float32 images ``[B, 3, 8h, 8w]`` in [0, 1] (:func:`flux2_vae_decode`)."""
        return flux2_vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, H, W]


__all__ = ["FLUX2_LORA_TARGET_MODULES", "FLUX2_VAE", "Flux2FamilyPolicy", "flux2_ids", "flux2_vae_decode", "patchify",
           "unpatchify"]
