"""Wan2.2 text-to-video as a ``FlowPolicy`` (``model.pipeline: wan2.2``): the Wan family's math
(:mod:`flowrl.pipelines.wan_family`) on Wan2.2's pipelines. T2V-A14B: two experts switched at
``boundary_ratio`` (one module, :class:`flowrl.pipelines.experts.TwoExperts`), the low-noise expert's CFG scale
``guidance_scale_2``, the experts a LoRA trains ``train_experts``; TI2V-5B: one expert with its own VAE (48
channels, 16x spatial) and per-token timesteps (``expand_timesteps``)."""
from __future__ import annotations

import os
from typing import Literal, Optional, Union

import torch

from flowrl.options import Guidance, PositiveInt

from .base import IMAGE_SIZE
from .common import Resolution, Schedule, Shift, TextTokens
from .experts import EXPERTS, TwoExperts, expert_lora_load_hint, expert_lora_parts, high_noise_rows
from .wan_family import WAN_T2V, WAN21_T2V_14B, WanFamilyPolicy, wan_published


# Wan-AI/Wan2.2-T2V-A14B-Diffusers: model_index.json boundary_ratio 0.875; transformer/ and transformer_2/config.json
# both Wan2.1-T2V-14B's architecture (diffusers' convert_wan_to_diffusers.py "Wan2.2-T2V-A14B"); Wan2.1's VAE, UMT5
WAN22_T2V_A14B = dict(WAN21_T2V_14B, boundary_ratio=0.875)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers: model_index.json expand_timesteps true, no transformer_2; transformer 30 blocks of
# 24 heads of 128 = 3072 wide, FFN 14336, 48 latent channels; vae/config.json the Wan2.2 VAE: residual blocks, patch 2
# (16x spatial, 4x temporal), 48 channels and their mean / std (its `clip_output` key, unknown to diffusers 0.42, left out)
WAN22_TI2V_5B = dict(WAN_T2V, num_attention_heads=24, num_layers=30, ffn_dim=14336, in_channels=48, out_channels=48,
                     expand_timesteps=True)
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
                  0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                  -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723,
                  -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667],
    latents_std=[0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885,
                 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338,
                 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458,
                 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744])


class Wan22Policy(WanFamilyPolicy):
    """``FlowPolicy`` for Wan2.2 text-to-video (module doc). Besides :class:`WanPolicy`'s arguments, for two experts:
    ``guidance_scale_2`` the low-noise expert's CFG scale (the pipeline's; None: ``guidance_scale``; needs
    ``guidance_scale > 1``, as the pipeline runs no CFG at 1.0); ``train_experts`` the experts a LoRA / full
    fine-tune trains, ``[high, low]`` (None: both), ``[high]`` or ``[low]``."""

    kind = "wan2.2"
    wan22 = True
    tiny_kinds = ("wan2.2", "wan2.2-ti2v")
    example_hub_id = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    published = {m.source: m for m in (
        wan_published(example_hub_id, WAN22_T2V_A14B, "Wan2.2-T2V-A14B", "wan2.2-a14b-arch"),
        wan_published("Wan-AI/Wan2.2-TI2V-5B-Diffusers", WAN22_TI2V_5B, "Wan2.2-TI2V-5B", "wan2.2-5b-arch", WAN22_VAE))}

    def __init__(self, pipe, *, guidance_scale: Guidance = 5.0, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 512, num_frames: Optional[PositiveInt] = None, shift: Shift = None,
                 schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu", guidance_scale_2: Optional[Guidance] = None,
                 train_experts: Optional[list[Literal[tuple(EXPERTS)]]] = None):
        super().__init__(pipe, guidance_scale=guidance_scale, negative_prompt=negative_prompt, num_frames=num_frames,
                         max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                         resolution=resolution, device=device)  # (listed: from_pretrained routes options by name)
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps"))
        self.boundary_timestep: Optional[float] = None  # rows at timestep >= this use transformer
        if pipe.transformer_2 is None:
            if guidance_scale_2 is not None or train_experts is not None:
                raise ValueError("guidance_scale_2 and train_experts need Wan2.2's two experts (T2V-A14B: transformer_2 "
                                 "and boundary_ratio); this model has one transformer")
        else:
            self.transformer = TwoExperts(pipe.transformer, pipe.transformer_2, pipe.config.boundary_ratio,
                                          pipe.scheduler.config.num_train_timesteps, train_experts or tuple(EXPERTS))
            self.boundary_timestep = self.transformer.boundary
        self.check_option_rules({"guidance_scale_2": guidance_scale_2}, self.guidance_scale)
        self.guidance_scale_2 = self.guidance_scale if guidance_scale_2 is None else float(guidance_scale_2)

    @classmethod
    def check_option_rules(cls, options: dict, guidance_scale: Optional[float]) -> None:
        """``guidance_scale_2`` other than ``guidance_scale`` needs ``guidance_scale > 1``: WanPipeline runs no CFG
        at 1.0."""
        g2 = options.get("guidance_scale_2")
        if g2 is not None and guidance_scale is not None and g2 != guidance_scale and guidance_scale == 1.0:
            raise ValueError(f"model.options.guidance_scale_2={g2} needs model.guidance_scale > 1 (WanPipeline runs no "
                             f"CFG at 1.0, on either expert): raise model.guidance_scale or drop guidance_scale_2")

    tiny_multiple = classmethod(lambda cls: 32)  # TI2V-5B: VAE factor 16 x patch 2

    @classmethod
    def tiny_components(cls, kind: str = "wan2.2", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """The tiny ``wan``'s UMT5, tokenizer and scheduler with 1-layer experts: ``wan2.2`` two on its VAE, split
        at boundary_ratio 0.5 (A14B's 0.875 would leave the high-noise expert one uniform training time in 8: the
        tiny runs' few samples must reach both); ``wan2.2-ti2v`` one of 48 channels on a tiny Wan2.2 VAE."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        parts = super().tiny_components("wan", image_size, seed)

        def expert(channels: int, offset: int) -> WanTransformer3DModel:
            torch.manual_seed(seed + offset)
            config = cls.shrink_config(dict(WAN_T2V, in_channels=channels, out_channels=channels))
            return WanTransformer3DModel(**{**config, "num_layers": 1})

        if kind == "wan2.2":
            return {**parts, "transformer": expert(16, 2), "transformer_2": expert(16, 3), "boundary_ratio": 0.5}
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(**{**WAN22_VAE, "base_dim": 8, "decoder_base_dim": 8, "dim_mult": [1, 1, 1, 1],
                                  "num_res_blocks": 1})
        return {**parts, "vae": vae, "transformer": expert(48, 2), "expand_timesteps": True}

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """WanPolicy's; the pipeline gets both experts back as its ``transformer`` and ``transformer_2``."""
        experts = self.transformer
        if isinstance(experts, TwoExperts):  # the base saves self.transformer as the pipeline's transformer
            self.transformer, self.pipe.transformer_2 = experts.transformer, experts.transformer_2
        try:
            super().save_pretrained(path)
        finally:
            self.transformer = experts

    lora_parts = staticmethod(expert_lora_parts)  # flowrl export: one LoRA file per trained expert

    @classmethod
    def lora_load_hint(cls, components=("transformer",)) -> str:
        return expert_lora_load_hint(cls.pipeline_class, components)

    def forward_settings(self) -> dict:
        return {"expand_timesteps": self.expand_timesteps}

    def cfg_scale_for(self, sigma: torch.Tensor, ndim: int):
        """``guidance_scale`` on the high-noise expert's rows, ``guidance_scale_2`` on the low-noise one's."""
        if self.boundary_timestep is None or self.guidance_scale_2 == self.guidance_scale:
            return self.cfg_scale
        high = high_noise_rows(sigma * 1000.0, self.boundary_timestep)  # [B]: the timestep transformer_inputs passes
        scale = torch.where(high, self.guidance_scale, self.guidance_scale_2)  # [B]
        return scale.float().view(-1, *[1] * (ndim - 1))


__all__ = ["WAN22_T2V_A14B", "WAN22_TI2V_5B", "WAN22_VAE", "Wan22Policy"]
