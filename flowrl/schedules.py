"""Sigma schedules for rectified-flow sampling (docs/algorithms.md §1).

A schedule is a float32 tensor of ``num_steps + 1`` noise levels, running from (about) 1
down to exactly 0. Step ``i`` moves the latent from ``sigmas[i]`` to ``sigmas[i + 1]``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

SCHEDULE_KINDS = ("diffusers", "linear")


def shift_sigmas(s: np.ndarray, shift: float) -> np.ndarray:
    """Timestep shift of SD3 (Esser et al. 2024, eq. 23): ``m s / (1 + (m - 1) s)``."""
    return shift * s / (1 + (shift - 1) * s)


def time_shift_exponential(mu: float, s: np.ndarray) -> np.ndarray:
    """FLUX's resolution-dependent shift: ``e^mu / (e^mu + (1/s - 1))`` (diffusers' ``time_shift``)."""
    return math.exp(mu) / (math.exp(mu) + (1 / s - 1) ** 1.0)


def flux_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
            base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FLUX's ``mu`` for dynamic shifting: linear in the packed image sequence length."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def _check(num_steps: int, shift: float) -> None:
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r} (1.0 means no shift)")


def flow_sigmas(num_steps: int, shift: float = 1.0, kind: str = "diffusers") -> torch.Tensor:
    """Sigma schedule of length ``num_steps + 1`` ending in 0, float32.

    ``kind="diffusers"`` equals ``FlowMatchEulerDiscreteScheduler(shift=shift)
    .set_timesteps(num_steps)`` exactly (1000 training steps, ``sigma_min`` = 1/1000 shifted
    twice). ``kind="linear"`` is DanceGRPO/BranchGRPO's ``linspace(1, 0, T + 1)`` then shifted.
    """
    _check(num_steps, shift)
    if kind == "diffusers":
        n_train = 1000
        train_t = torch.from_numpy(np.linspace(1, n_train, n_train, dtype=np.float32)[::-1].copy())
        train_s = train_t / n_train
        train_s = shift * train_s / (1 + (shift - 1) * train_s)
        sigma_max, sigma_min = train_s[0].item(), train_s[-1].item()
        timesteps = np.linspace(sigma_max * n_train, sigma_min * n_train, num_steps)
        s = timesteps / n_train
        s = shift_sigmas(s, shift)
        s = torch.from_numpy(s).to(dtype=torch.float32)
    elif kind == "linear":
        s = torch.from_numpy(shift_sigmas(np.linspace(1.0, 0.0, num_steps + 1)[:-1], shift)).float()
    else:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {SCHEDULE_KINDS}")
    return torch.cat([s, torch.zeros(1)])


def flux_sigmas(num_steps: int, image_seq_len: int, *, base_seq_len: int = 256,
                max_seq_len: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15) -> torch.Tensor:
    """FLUX-dev's schedule: ``linspace(1, 1/T, T)`` with the exponential time shift at
    ``mu = flux_mu(image_seq_len)``, then 0 appended (what ``FluxPipeline`` passes to its
    scheduler)."""
    _check(num_steps, 1.0)
    mu = flux_mu(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift)
    s = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    s = torch.from_numpy(time_shift_exponential(mu, s)).to(torch.float32)
    return torch.cat([s, torch.zeros(1)])
