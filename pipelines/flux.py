"""FLUX.1 (dev / schnell) as a ``FlowPolicy``, over diffusers ``FluxPipeline`` components.

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

import json
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from flowrl.schedules import flow_sigmas, flux_sigmas, shift_sigmas
from flowrl.seeding import seeded_randn

from .common import (DTypeArg, cfg_combine, cfg_halves, check_model_path, encode_with_negative, resolve_dtype,
                     transformer_dtype, vae_decode)
from .sd3 import Resolution, resolve_resolution

# Flow-GRPO's LoRA targets for FLUX (scripts/train_flux.py: r=64, alpha=128, gaussian init): the
# joint-attention projections of both streams plus both streams' feed-forwards. (As peft suffix
# patterns, attn.to_q/k/v also match the single-stream blocks' projections.)
FLUX_LORA_TARGET_MODULES = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]`` 2x2 patches, row-major (``FluxPipeline._pack_latents``)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)  # [B, (h/2)(w/2), 4C]


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of ``pack_latents``: ``[B, (h/2)(w/2), 4C]`` -> ``[B, C, h, w]`` (``h, w`` in latent pixels)."""
    b, _, c4 = x.shape
    x = x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # [B, C, h/2, 2, w/2, 2]
    return x.reshape(b, c4 // 4, h, w)  # [B, C, h, w]


def latent_image_ids(h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """RoPE position ids of the packed image tokens ``[(h/2)(w/2), 3]``: (0, row, col)
    (``FluxPipeline._prepare_latent_image_ids``)."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)  # built on the device: no host-to-device copy
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype=dtype)  # [(h/2)(w/2), 3]


class FluxPolicy:
    """``FlowPolicy`` for FLUX.1 (see module doc).

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

    kind = "flux"

    def __init__(self, pipe, *, guidance_scale: float = 3.5, true_cfg_scale: float = 1.0, negative_prompt: str = "",
                 max_sequence_length: int = 512, shift: Optional[float] = None, schedule: str = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale must be >= 0, got {guidance_scale}")
        if true_cfg_scale < 1.0:
            raise ValueError(f"true_cfg_scale must be >= 1.0 (1.0 = no CFG), got {true_cfg_scale}")
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        cfg = pipe.scheduler.config
        unsupported = [k for k in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
                                   "use_beta_sigmas", "invert_sigmas", "use_flow_sigmas") if cfg.get(k)]
        if cfg.get("use_dynamic_shifting") and cfg.get("time_shift_type", "exponential") != "exponential":
            unsupported.append("time_shift_type=" + str(cfg.get("time_shift_type")))
        if unsupported and shift is None:
            raise ValueError(f"FluxPolicy cannot reproduce a scheduler with {unsupported}; pass shift= to use "
                             f"flowrl's static-shift schedule instead")
        if shift is not None:
            flow_sigmas(1, float(shift), schedule)  # validate early
        self.device = torch.device(device)
        self.pipe = pipe.to(self.device)
        self.transformer = pipe.transformer
        self.vae = pipe.vae.requires_grad_(False).eval()
        for te in (pipe.text_encoder, pipe.text_encoder_2):
            if te is not None:
                te.requires_grad_(False).eval()
        self.pipe.set_progress_bar_config(disable=True)
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.guidance_scale = float(guidance_scale)
        self.true_cfg_scale = float(true_cfg_scale)
        self.negative_prompt = str(negative_prompt)
        self.max_sequence_length = int(max_sequence_length)
        self.shift = None if shift is None else float(shift)
        self.schedule = schedule
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.height, self.width = resolve_resolution(resolution, 128 * self.vae_scale_factor, self.vae_scale_factor * 2)
        h, w = 2 * (self.height // (self.vae_scale_factor * 2)), 2 * (self.width // (self.vae_scale_factor * 2))
        self.latent_shape = (int(self.transformer.config.in_channels) // 4, h, w)  # (C, h, w), unpacked
        self.image_seq_len = (h // 2) * (w // 2)  # packed tokens per image
        self.lora_target_modules = list(FLUX_LORA_TARGET_MODULES)
        self._negative: Optional[dict[str, torch.Tensor]] = None  # cached [1, ...] negative embeddings

    # --- loading -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_id: Union[str, os.PathLike], *, guidance_scale: float = 3.5,
                        true_cfg_scale: float = 1.0, negative_prompt: str = "",
                        device: Union[str, torch.device] = "cpu", dtype: DTypeArg = torch.float32,
                        max_sequence_length: int = 512, shift: Optional[float] = None, schedule: str = "diffusers",
                        resolution: Resolution = None, gradient_checkpointing: bool = False,
                        **pipeline_kwargs) -> "FluxPolicy":
        """Load with ``FluxPipeline.from_pretrained(path_or_id, dtype=dtype, **pipeline_kwargs)``.

        ``dtype`` may be a name or a per-component dict (see ``SD3Policy.from_pretrained``);
        ``gradient_checkpointing`` recomputes block activations in the backward pass.
        """
        from diffusers import FluxPipeline

        from .tiny import read_flowrl_json

        if path_or_id is None or str(path_or_id) == "":
            raise ValueError("pass a model directory or hub id (`flowrl make-tiny flux DIR` writes a tiny offline one)")
        check_model_path(str(path_or_id), "flux")
        if resolution is None:
            resolution = read_flowrl_json(path_or_id).get("resolution")
        pipe = FluxPipeline.from_pretrained(str(path_or_id), dtype=resolve_dtype(dtype), **pipeline_kwargs)
        if gradient_checkpointing:
            pipe.transformer.enable_gradient_checkpointing()
        return cls(pipe, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
                   negative_prompt=negative_prompt, max_sequence_length=max_sequence_length, shift=shift,
                   schedule=schedule, resolution=resolution, device=device)

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """Save the whole pipeline (with the current ``self.transformer``) as a diffusers directory."""
        from .tiny import FLOWRL_JSON

        self.pipe.transformer = self.transformer
        self.pipe.save_pretrained(str(path))
        (Path(path) / FLOWRL_JSON).write_text(json.dumps({"kind": self.kind, "resolution": [self.height, self.width]}))

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
        return encode_with_negative(self, prompts, use_negative=self.true_cfg_scale > 1.0)

    def _forward(self, packed: torch.Tensor, sigma: torch.Tensor, pe: torch.Tensor, pooled: torch.Tensor,
                 img_ids: torch.Tensor) -> torch.Tensor:
        dtype = transformer_dtype(self.transformer)
        b = packed.shape[0]
        guidance = (torch.full((b,), self.guidance_scale, dtype=torch.float32, device=self.device)
                    if self.guidance_embeds else None)  # [B]
        txt_ids = torch.zeros(pe.shape[1], 3, device=self.device, dtype=dtype)  # [L, 3]
        return self.transformer(hidden_states=packed.to(dtype), timestep=sigma, guidance=guidance,
                                pooled_projections=pooled.to(self.device, dtype),
                                encoder_hidden_states=pe.to(self.device, dtype), txt_ids=txt_ids, img_ids=img_ids,
                                return_dict=False)[0]  # [B, (h/2)(w/2), 4C]

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 ``[B, C, h, w]`` for unpacked latents; ``sigma`` in [0, 1].

        Differentiable in the transformer's parameters (no ``no_grad`` here); true CFG as in
        ``pipelines.common.cfg_halves`` (doubled batch; the unconditional half alone under
        ``no_grad`` in training with ``train.cfg_uncond_grad`` off).
        """
        x = latents.to(self.device)  # [B, C, h, w]
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"FLUX latents need even height and width (2x2 packing), got {tuple(x.shape)}")
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        img_ids = latent_image_ids(h, w, self.device, transformer_dtype(self.transformer))  # [(h/2)(w/2), 3]
        packed = pack_latents(x)  # [B, (h/2)(w/2), 4C]
        if self.true_cfg_scale == 1.0:
            v = self._forward(packed, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"], img_ids)
            return unpack_latents(v.float(), h, w)  # [B, C, h, w]
        fwd = lambda p, s, pe, pooled: self._forward(p, s, pe, pooled, img_ids)  # noqa: E731
        uncond, text = cfg_halves(fwd, (packed, sigma, cond["negative_prompt_embeds"],  # [B, (h/2)(w/2), 4C] each
                                        cond["negative_pooled_prompt_embeds"]),
                                  (packed, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"]))
        return unpack_latents(cfg_combine(uncond, text, self.true_cfg_scale), h, w)  # [B, C, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Unpacked latents ``[B, C, h, w]`` -> float32 images ``[B, 3, 8h, 8w]`` in [0, 1]
        (``latents / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped)."""
        return vae_decode(self.vae, latents, self.device)  # [B, 3, H, W]

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        """Standard-normal float32 ``[B, C, h, w]`` (unpacked), row i depending only on ``seeds[i]``."""
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, C, h, w]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]`` float32 ending in 0; by default exactly what ``FluxPipeline`` gives its
        scheduler at this resolution (see class doc)."""
        if self.shift is not None:
            return flow_sigmas(num_steps, self.shift, self.schedule)
        cfg = self.pipe.scheduler.config
        if cfg.get("use_dynamic_shifting", False):
            return flux_sigmas(num_steps, self.image_seq_len, base_seq_len=cfg.get("base_image_seq_len", 256),
                               max_seq_len=cfg.get("max_image_seq_len", 4096), base_shift=cfg.get("base_shift", 0.5),
                               max_shift=cfg.get("max_shift", 1.15))
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        s = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)  # the pipeline's default sigmas
        s = torch.from_numpy(shift_sigmas(s, float(cfg.get("shift", 1.0))).astype(np.float32))
        return torch.cat([s, torch.zeros(1)])
