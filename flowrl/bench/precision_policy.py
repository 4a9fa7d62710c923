"""The policies ``flowrl bench precision`` measures on its original pipelines: digits, sd3-mid, sd3, flux."""
from __future__ import annotations

import hashlib
from typing import Optional

import torch

from ..schedules import flow_sigmas
from ..seeding import seeded_randn

PIPELINES = ("digits", "sd3-mid", "sd3", "flux")


def prompt_ids(prompts: list[str]) -> list[int]:
    """A stable integer per prompt (SHA-256 prefix): seeds of the random stand-in text embeddings."""
    return [int(hashlib.sha256(p.encode()).hexdigest()[:8], 16) for p in prompts]


def sd3_mid_config() -> dict:
    """SD3Transformer2DModel, 4 layers x 512 wide (8 heads of 64), 16 x 64 x 64 latents, patch 2:
    1024 image tokens, 36.04M parameters."""
    return dict(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=4, attention_head_dim=64,
                num_attention_heads=8, joint_attention_dim=512, caption_projection_dim=512,
                pooled_projection_dim=256, pos_embed_max_size=64)


class SD3MidPolicy:
    """A ``FlowPolicy`` over a random-init SD3 transformer, for timing only (rewards meaningless).

    Prompts map to fixed pseudo-random embeddings (16 tokens, seeded by the prompt's hash);
    ``decode`` is a sigmoid of the first three latent channels, ``[B, 3, 64, 64]``.
    """

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 shift: float = 3.0):
        from diffusers import SD3Transformer2DModel

        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.transformer = SD3Transformer2DModel(**sd3_mid_config()).to(self.device).eval()
        if dtype != torch.float32:
            self.transformer.to(dtype=dtype)
        self.transformer.requires_grad_(False)
        self.dtype = dtype
        self.latent_shape = (16, 64, 64)
        self.shift = shift

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        cfg = self.transformer.config
        ids = prompt_ids(prompts)
        ehs = seeded_randn(ids, (16, cfg.joint_attention_dim), stream=0, device=self.device)  # [B, 16, 512]
        pooled = seeded_randn(ids, (cfg.pooled_projection_dim,), stream=1, device=self.device)  # [B, 256]
        return {"encoder_hidden_states": ehs, "pooled_projections": pooled}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        dtype = self.dtype
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        return self.transformer(hidden_states=latents.to(self.device, dtype), timestep=sigma * 1000.0,
                                encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
                                pooled_projections=cond["pooled_projections"].to(dtype), return_dict=False)[0].float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(latents[:, :3].float())  # [B, 3, 64, 64]

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, 16, 64, 64]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, self.shift)


def build_bench_policy(pipeline: str, model_path: Optional[str], device: str, dtype: torch.dtype):
    """The policy a precision benchmark runs."""
    if pipeline == "digits":
        from ..pipelines.digits import load_digits_policy

        return load_digits_policy(model_path, guidance_scale=1.0, device=device)
    if pipeline == "sd3-mid":
        return SD3MidPolicy(device=device, dtype=dtype)
    if pipeline in ("sd3", "flux"):
        if not model_path:
            raise ValueError(f"--pipeline {pipeline} needs --model-path (a diffusers directory or hub id; "
                             f"`flowrl make-tiny {pipeline} DIR` writes a tiny offline one)")
        from ..pipelines import build_policy

        return build_policy(pipeline, model_path, device=device, dtype=dtype)
    raise ValueError(f"unknown pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}")


def build_reward(name: str, device: str):
    """A reward by name (``digits`` runs on ``device``)."""
    from ..rewards import build

    return build(name, device=device) if name == "digits" else build(name)
