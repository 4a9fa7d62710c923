"""The seams of flowrl: Protocols for a policy, a sampler, a reward and a quantizer.

Nothing inherits from these; anything with the right methods fits (docs/design.md).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import nn

# name -> batch-first tensor, e.g. {"encoder_hidden_states": [B, L, D], "pooled_projections": [B, P]}
Conditioning = Mapping[str, torch.Tensor]


@runtime_checkable
class FlowPolicy(Protocol):
    """A rectified-flow image model: ``x_t = (1 - sigma) x0 + sigma eps``, velocity ``eps - x0``."""

    transformer: nn.Module  # the trainable denoiser (LoRA goes here)

    def encode_prompts(self, prompts: list[str]) -> Conditioning: ...
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor: ...
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...          # [B, 3, H, W] in [0, 1]
    def initial_noise(self, seeds: list[int]) -> torch.Tensor: ...       # [B, C, h, w], one generator per seed
    def sigmas(self, num_steps: int) -> torch.Tensor: ...                # [num_steps + 1], ends in 0


@runtime_checkable
class Reward(Protocol):
    """``(images [B, 3, H, W] in [0, 1], prompts) -> float32 [B]``; NaN means not applicable."""

    name: str

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor: ...


RewardFn = Callable[..., torch.Tensor]


@runtime_checkable
class Sampler(Protocol):
    def __call__(self, policy: FlowPolicy, prompts: list[str], reward: Optional[RewardFn], seed: int = 0): ...


@runtime_checkable
class Quantizer(Protocol):
    name: str

    def available(self) -> bool: ...
    def quantize(self, module: nn.Module, calibrate: Callable[[nn.Module], None]) -> nn.Module: ...


def index_cond(cond: Conditioning, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``index`` [M] of every conditioning tensor (prompt -> transition rows)."""
    return {k: v.index_select(0, index.to(v.device)) for k, v in cond.items()}


def cat_cond(conds: list[Conditioning]) -> dict[str, torch.Tensor]:
    """Concatenate conditionings along the batch dimension."""
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}
