"""Stable Diffusion 3 / 3.5 as a ``FlowPolicy``, over diffusers ``StableDiffusion3Pipeline`` components.

Latents are the VAE's ``[B, 16, H/8, W/8]``; the MMDiT (``SD3Transformer2DModel``) is the
trainable part, the three text encoders and the VAE are frozen. Guidance is classifier-free
(one doubled batch, uncond first, as the pipeline does; see ``SD3Policy.velocity`` for training).
The model's time input is ``timestep = sigma * 1000`` (the pipeline passes ``scheduler.timesteps``,
which are that).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from flowrl.schedules import flow_sigmas
from flowrl.seeding import seeded_randn

from .common import (DTypeArg, cfg_combine, cfg_halves, check_model_path, encode_with_negative, resolve_dtype,
                     transformer_dtype, vae_decode)

# Flow-GRPO's LoRA targets for SD3.5 (scripts/train_sd3.py: r=32, alpha=64, gaussian init): every
# projection of the joint attention, image stream (to_*) and text stream (add_*_proj, to_add_out).
SD3_LORA_TARGET_MODULES = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)

Resolution = Union[int, Sequence[int], None]


def resolve_resolution(resolution: Resolution, default: int, multiple: int) -> tuple[int, int]:
    """``(H, W)`` in pixels from an int, a pair or None (-> ``default``), checked against ``multiple``."""
    if resolution is None:
        resolution = default
    hw = (resolution, resolution) if isinstance(resolution, int) else tuple(int(r) for r in resolution)
    if len(hw) != 2:
        raise ValueError(f"resolution must be an int or an (H, W) pair, got {resolution!r}")
    h, w = hw
    if h <= 0 or w <= 0 or h % multiple or w % multiple:
        raise ValueError(f"resolution must be positive multiples of {multiple} pixels (VAE factor x patch size), "
                         f"got {(h, w)}")
    return h, w


class SD3Policy:
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

    def __init__(self, pipe, *, guidance_scale: float = 4.5, negative_prompt: str = "",
                 max_sequence_length: int = 256, shift: Optional[float] = None, schedule: str = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0 (1.0 = no guidance), got {guidance_scale}")
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        sched_cfg = pipe.scheduler.config
        if shift is None:
            if sched_cfg.get("use_dynamic_shifting", False):
                raise ValueError("this SD3 scheduler uses dynamic shifting; pass an explicit static shift= "
                                 "(flowrl's SD3 schedule is the static-shift one)")
            shift = float(sched_cfg.get("shift", 1.0))
        flow_sigmas(1, float(shift), schedule)  # validates shift and schedule early
        self.device = torch.device(device)
        self.pipe = pipe.to(self.device)
        self.transformer = pipe.transformer
        self.vae = pipe.vae.requires_grad_(False).eval()
        for te in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            if te is not None:
                te.requires_grad_(False).eval()
        self.pipe.set_progress_bar_config(disable=True)
        self.guidance_scale = float(guidance_scale)
        self.negative_prompt = str(negative_prompt)
        self.max_sequence_length = int(max_sequence_length)
        self.shift, self.schedule = float(shift), schedule
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.patch_size = int(self.transformer.config.patch_size)
        default_size = int(self.transformer.config.sample_size) * self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, default_size, self.vae_scale_factor * self.patch_size)
        self.latent_shape = (int(self.transformer.config.in_channels),
                             self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)  # (C, h, w)
        self.lora_target_modules = list(SD3_LORA_TARGET_MODULES)
        self._negative: Optional[dict[str, torch.Tensor]] = None  # cached [1, ...] negative embeddings

    # --- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_id: Union[str, os.PathLike], *, guidance_scale: float = 4.5,
                        negative_prompt: str = "", device: Union[str, torch.device] = "cpu",
                        dtype: DTypeArg = torch.float32, max_sequence_length: int = 256,
                        shift: Optional[float] = None, schedule: str = "diffusers", resolution: Resolution = None,
                        gradient_checkpointing: bool = False, **pipeline_kwargs) -> "SD3Policy":
        """Load with ``StableDiffusion3Pipeline.from_pretrained(path_or_id, dtype=dtype, **pipeline_kwargs)``.

        ``dtype`` may be a name (``"bfloat16"``) or a per-component dict (``{"default": "bfloat16",
        "vae": "float32"}``), as YAML recipes give it. ``gradient_checkpointing`` recomputes the
        transformer's block activations in the backward pass (less memory, ~30% slower updates).
        A local directory may hold a ``flowrl.json`` (written by ``flowrl make-tiny``) whose
        ``resolution`` is the default when ``resolution`` is None.
        """
        from diffusers import StableDiffusion3Pipeline

        from .tiny import read_flowrl_json

        if path_or_id is None or str(path_or_id) == "":
            raise ValueError("pass a model directory or hub id (`flowrl make-tiny sd3 DIR` writes a tiny offline one)")
        check_model_path(str(path_or_id), "sd3")
        if resolution is None:
            resolution = read_flowrl_json(path_or_id).get("resolution")
        pipe = StableDiffusion3Pipeline.from_pretrained(str(path_or_id), dtype=resolve_dtype(dtype), **pipeline_kwargs)
        if gradient_checkpointing:
            pipe.transformer.enable_gradient_checkpointing()
        return cls(pipe, guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                   max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                   resolution=resolution, device=device)

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """Save the whole pipeline (with the current ``self.transformer``) as a diffusers directory."""
        from .tiny import FLOWRL_JSON

        self.pipe.transformer = self.transformer
        self.pipe.save_pretrained(str(path))
        (Path(path) / FLOWRL_JSON).write_text(json.dumps({"kind": self.kind, "resolution": [self.height, self.width]}))

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
        return encode_with_negative(self, prompts, use_negative=self.guidance_scale > 1.0)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, pe: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        dtype = transformer_dtype(self.transformer)
        return self.transformer(hidden_states=x.to(dtype), timestep=sigma * 1000.0,
                                encoder_hidden_states=pe.to(self.device, dtype),
                                pooled_projections=pooled.to(self.device, dtype), return_dict=False)[0]

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 ``[B, C, h, w]``; ``sigma`` in [0, 1] (float or [B]).

        With guidance, ``u + s (c - u)`` in float32 (``pipelines.common.cfg_halves``: one doubled
        batch ``[uncond; cond]``; in training with ``train.cfg_uncond_grad`` off, the unconditional
        half alone under ``no_grad``). Differentiable in the transformer's parameters.
        """
        x = latents.to(self.device)  # [B, C, h, w]
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        if self.guidance_scale == 1.0:
            return self._forward(x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"]).float()
        uncond, text = cfg_halves(self._forward,  # [B, C, h, w] each
                                  (x, sigma, cond["negative_prompt_embeds"], cond["negative_pooled_prompt_embeds"]),
                                  (x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"]))
        return cfg_combine(uncond, text, self.guidance_scale)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images float32 ``[B, 3, 8h, 8w]`` in [0, 1] (the pipeline's
        ``latents / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped)."""
        return vae_decode(self.vae, latents, self.device)  # [B, 3, H, W]

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        """Standard-normal float32 ``[B, C, h, w]``, row i depending only on ``seeds[i]``."""
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, C, h, w]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]`` float32 from 1 to 0: ``flow_sigmas(num_steps, shift, schedule)``."""
        return flow_sigmas(num_steps, self.shift, self.schedule)
