"""Noise scales of the Flow-GRPO SDE step, and TempFlow-GRPO's noise-aware step weights. Pure functions.

Step math (how much noise each step of a schedule injects), used by the TempFlow sampler.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .sde import sde_step

__all__ = ["step_noise_scales", "noise_aware_weights"]


def step_noise_scales(sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
    """Standard deviation of every Flow-GRPO SDE step, ``std_t * sqrt(-dt_t)`` -> ``[T]`` float32.

    ``sigmas`` is a ``[T + 1]`` schedule ending in 0. The value is what
    :func:`flowrl.sde.sde_step` uses as its noise scale (it is computed by that function, so the
    two cannot drift apart): ``std_t = a sqrt(sigma_t / (1 - sigma'))`` with ``sigma' = sigma_next``
    when ``sigma_t == 1`` (Flow-GRPO, arXiv 2505.05470, eq. 9), in latent units per element.
    """
    s = torch.as_tensor(sigmas, dtype=torch.float32).flatten()  # [T + 1]
    if s.numel() < 2:
        raise ValueError(f"sigmas must hold at least 2 values (a [T + 1] schedule), got {s.numel()}")
    if not bool((s[1:] < s[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing (sigma_{i+1} < sigma_i)")
    t = s.numel() - 1
    dummy = torch.zeros(t, 1)  # [T, 1]: the scale does not depend on x or v
    return sde_step(dummy, dummy, s[:-1], s[1:], noise_level=float(noise_level)).std  # [T]


def noise_aware_weights(sigmas: torch.Tensor, noise_level: float, trained_steps: Sequence[int]) -> torch.Tensor:
    """Noise-aware loss weight of every step (TempFlow-GRPO, arXiv 2508.04324, docs/algorithms.md §5).

    ``w_t = (std_t sqrt(-dt_t)) / mean_{t' in trained}(std_t' sqrt(-dt_t'))`` for ``t`` in
    ``trained_steps``, so the weights **average 1 over the trained steps** (each trained step
    once, whatever the number of transitions stored per step); untrained steps get 0.

    Args:
        sigmas: ``[T + 1]`` schedule ending in 0 (``policy.sigmas(T)``).
        noise_level: Flow-GRPO's ``a`` (> 0). The normalised weights do not depend on it
            (``std_t`` is proportional to ``a``); the normaliser ``1 / mean`` does.
        trained_steps: distinct step indices in ``[0, T)``.
    Returns:
        ``[T]`` float32, indexed by step: ``weights[transitions.step]`` gives one per transition.

    For SD3.5-M settings (a = 0.7, shift 3, T = 10, diffusers schedule, steps 0..8) the
    normaliser ``1 / mean`` is 2.252 (a = 0.9: 1.752) and the weights are
    1.577, 1.673, 1.207, 1.004, 0.882, 0.795, 0.719, 0.635, 0.508: the second step is the
    largest, because the first step's ``std_t`` divides by ``1 - sigma_next`` instead of
    ``1 - sigma``.
    """
    if not noise_level > 0:
        raise ValueError(f"noise_level must be > 0 for noise-aware weights (0 injects no noise), got {noise_level}")
    scales = step_noise_scales(sigmas, noise_level)  # [T]
    t = scales.numel()
    steps = [int(k) for k in trained_steps]
    if not steps:
        raise ValueError("trained_steps is empty: pass at least one step index")
    if len(set(steps)) != len(steps):
        raise ValueError(f"trained_steps has duplicates: {steps}")
    bad = [k for k in steps if not 0 <= k < t]
    if bad:
        raise ValueError(f"trained_steps {bad} are outside [0, T={t})")
    idx = torch.tensor(steps, dtype=torch.long)  # [K]
    weights = torch.zeros(t, dtype=torch.float32)  # [T]
    weights[idx] = scales[idx] / scales[idx].mean()  # [K], mean over the K trained steps = 1
    return weights
