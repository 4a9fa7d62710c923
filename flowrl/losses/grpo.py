"""GRPO-family losses (SPEC sections 2-3): the clipped surrogate and the KL to the reference."""
from __future__ import annotations

import torch


def grpo_clipped_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      clip_range: float, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip surrogate of Flow-GRPO (arXiv 2505.05470 eq. 4), per transition.

    ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` with ``r = exp(logp - logp_old)``, times
    ``weight`` (TempFlow's noise-aware weights, else 1), **mean** over the ``[M]`` rows.
    Returns (loss scalar, stats: clip_fraction, approx_kl, ratio_mean).
    """
    ratio = torch.exp(log_prob - old_log_prob)  # [M]
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per = torch.maximum(unclipped, clipped)  # [M]
    if weight is not None:
        per = per * weight
    with torch.no_grad():
        stats = {"clip_fraction": ((ratio - 1).abs() > clip_range).float().mean().item(),
                 "approx_kl": (0.5 * (log_prob - old_log_prob) ** 2).mean().item(),
                 "ratio_mean": ratio.mean().item()}
    return per.mean(), stats


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's KL of two Gaussian steps with a shared std: ``mean_dims((mu - mu_ref)^2) / (2 std^2)``.

    ``mean``/``ref_mean`` [M, ...], ``std`` [M] (the step's ``std_t * sqrt(-dt)``; rows with
    std 0 contribute 0). Returns [M].
    """
    dims = tuple(range(1, mean.ndim))
    d2 = ((mean - ref_mean) ** 2).mean(dim=dims)  # [M]
    safe = torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(std > 0, d2 / (2 * safe**2), torch.zeros_like(d2))

