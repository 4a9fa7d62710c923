"""The seams of flowrl: Protocols for a policy, a sampler, a reward and a quantizer.

Nothing inherits from these; anything with the right methods fits (docs/design.md). Also the
one context manager that swaps a policy's transformer (:func:`swapped_transformer`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import nn

# name -> batch-first tensor, e.g. {"encoder_hidden_states": [B, L, D], "pooled_projections": [B, P]}
Conditioning = Mapping[str, torch.Tensor]


@runtime_checkable
class FlowPolicy(Protocol):
    """A rectified-flow image model: ``x_t = (1 - sigma) x0 + sigma eps``, velocity ``eps - x0``.

    A model conditioned on source images (editing) also declares ``max_sources`` (source images per
    prompt) and has ``source_conditioning(texts, sources) -> {name: [B, ...]}`` (``sources``: one tuple of
    ``[3, H, W]`` per row, in order), added to ``encode_prompts(texts)``' conditioning by
    :func:`flowrl.conditions.encode_conditions`, or replacing it when the model declares
    ``text_reads_sources`` (its text encoder sees the sources); video models decode ``[B, 3, F, H, W]``."""

    transformer: nn.Module  # the trainable denoiser (LoRA goes here)

    def encode_prompts(self, prompts: list[str]) -> Conditioning: ...
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor: ...
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...          # [B, 3, H, W]; video [B, 3, F, H, W]
    def initial_noise(self, seeds: list[int]) -> torch.Tensor: ...       # [B, *latent_shape], one generator per seed
    def sigmas(self, num_steps: int) -> torch.Tensor: ...                # [num_steps + 1], ends in 0


@runtime_checkable
class Reward(Protocol):
    """``(images [B, 3, H, W] in [0, 1], prompts) -> float32 [B]``; NaN means not applicable."""

    name: str

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor: ...


RewardFn = Callable[..., torch.Tensor]


@runtime_checkable
class Sampler(Protocol):
    """What the trainers call on a sampler (every entry of ``flowrl.registry.SAMPLERS`` has all of it).

    ``__call__`` returns a :class:`flowrl.rollout.Rollout`; ``seeds`` overrides the seeds derived
    from ``seed`` (how many depends on the sampler: per sample, per tree, per pool entry);
    ``iteration`` drives iteration-dependent schedules (sliding windows), unused by the others.
    """

    samples_per_prompt: int   # finished samples per prompt: the trainer's batch unit
    stores_transitions: bool  # whether rollouts hold stochastic transitions (the GRPO loss needs them)
    num_steps: int            # denoising steps (also the evaluation's)

    def __call__(self, policy: FlowPolicy, prompts: list[str], reward: Optional[RewardFn] = None, seed: int = 0, *,
                 iteration: int = 0, seeds: Optional[list[int]] = None): ...

    def check_available(self) -> None:
        """Raise ValueError naming what is missing if the sampler cannot run on this machine."""


SAMPLER_MEMBERS = ("__call__", "samples_per_prompt", "stores_transitions", "num_steps", "check_available")


def check_sampler(sampler) -> None:
    """Raise a TypeError naming the :class:`Sampler` members ``sampler`` lacks (None if it has all)."""
    missing = [m for m in SAMPLER_MEMBERS if not hasattr(sampler, m)]
    if missing:
        raise TypeError(f"{type(sampler).__name__} is not a flowrl Sampler: it lacks {missing}; see flowrl.types.Sampler")


@contextlib.contextmanager
def swapped_transformer(policy, module: nn.Module) -> Iterator[None]:
    """Inside, ``policy.transformer`` is ``module`` (so ``policy.velocity`` runs it); restored after.

    The one way to run a policy with another denoiser temporarily: the frozen reference copy, the
    Sol-RL quantized copy, a benchmark's variant. ``policy`` may be a wrapper that forwards the
    attribute (``flowrl.data.embeddings.CachedTextPolicy``)."""
    trained = policy.transformer
    policy.transformer = module
    try:
        yield
    finally:
        policy.transformer = trained


@runtime_checkable
class Quantizer(Protocol):
    name: str

    def available(self) -> bool: ...
    def quantize(self, module: nn.Module, calibrate: Callable[[nn.Module], None]) -> nn.Module: ...


def index_cond(cond: Conditioning, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``index`` [M] of every conditioning tensor (prompt -> transition rows)."""
    return {k: v.index_select(0, index.to(v.device)) for k, v in cond.items()}
