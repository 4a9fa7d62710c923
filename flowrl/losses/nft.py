"""DiffusionNFT loss (arXiv 2509.16117), the trainer of Sol-RL (arXiv 2604.06916); docs/algorithms.md §7.

For clean samples ``x0``, times ``t`` and noise ``eps`` the caller builds
``x_t = (1 - t) x0 + t eps`` and evaluates the velocities there. With the optimality
probability ``r = clip(clip(A, -Amax, Amax) / Amax / 2 + 0.5, 0, 1)``::

    v+ = beta v_theta + (1 - beta) v_old          (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta          (implicit negative policy)
    x0+- = x_t - t v+-
    L+- = mean((x0+- - x0)^2 / sg(mean|x0+- - x0|))      (weight floored at 1e-5)
    L = mean(r L+ + (1 - r) L-) / beta * Amax + beta_kl * mean((v_theta - v_ref)^2)

Means run over the non-batch dims per sample, then over the batch; ``sg`` is stop-gradient;
``v_old`` and ``v_ref`` carry no gradient. All math in float32 (the adaptive weight in float64).
"""
from __future__ import annotations

from typing import Optional

import torch


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             advantages: torch.Tensor, *, beta: float = 1.0, adv_clip_max: float = 5.0,
             v_ref: Optional[torch.Tensor] = None, beta_kl: float = 0.0, weight_floor: float = 1e-5
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT loss of a batch (module doc).

    Args:
        v_theta: ``[B, ...]`` velocity of the trained policy at ``(x_t, t)`` (gradient flows here).
        v_old: ``[B, ...]`` velocity of the old (sampling) policy at the same point.
        x_t: ``[B, ...]`` noised samples ``(1 - t) x0 + t eps``.
        x0: ``[B, ...]`` clean samples.
        t: ``[B]`` times in (0, 1] (sigma of the forward process).
        advantages: ``[B]`` per-sample advantages (reward normalised within the group).
        beta: guidance strength of the implicit policies (> 0).
        adv_clip_max: ``Amax``, advantage clip and loss scale (> 0).
        v_ref: ``[B, ...]`` reference-model velocity; needed when ``beta_kl > 0``.
        beta_kl: weight of the velocity-space KL ``mean((v_theta - v_ref)^2)``.
        weight_floor: floor of the adaptive weight ``mean|x0+- - x0|``.

    Returns:
        ``(loss scalar, stats)`` with stats ``policy_loss``, ``positive_loss``, ``negative_loss``,
        ``r_mean`` and ``kl`` (0 when unused), as floats.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    shape = x0.shape
    for name, x in (("v_theta", v_theta), ("v_old", v_old), ("x_t", x_t)):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but x0 has {tuple(shape)}; all must match")
    b = shape[0]
    if t.shape != (b,) or advantages.shape != (b,):
        raise ValueError(f"t and advantages must have shape [{b}], got {tuple(t.shape)} and {tuple(advantages.shape)}")
    if beta_kl > 0 and v_ref is None:
        raise ValueError("beta_kl > 0 needs v_ref, the reference model's velocity")
    dims = tuple(range(1, len(shape)))
    tb = t.float().view(-1, *([1] * (len(shape) - 1)))  # [B, 1, ...]
    v, v_o = v_theta.float(), v_old.detach().float()  # [B, ...]
    xt, x0f = x_t.float(), x0.float()

    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)  # [B]
    r = ((a / adv_clip_max) / 2.0 + 0.5).clamp(0.0, 1.0)  # [B], optimality probability

    v_pos = beta * v + (1.0 - beta) * v_o  # [B, ...]
    v_neg = (1.0 + beta) * v_o - beta * v
    err_pos = xt - tb * v_pos - x0f  # x0+ - x0
    err_neg = xt - tb * v_neg - x0f
    loss_pos = _adaptive_mse(err_pos, dims, weight_floor)  # [B]
    loss_neg = _adaptive_mse(err_neg, dims, weight_floor)  # [B]
    policy = (r * loss_pos + (1.0 - r) * loss_neg).mean() / beta * adv_clip_max
    loss = policy
    kl_value = 0.0
    if beta_kl > 0:
        kl = ((v - v_ref.detach().float()) ** 2).mean(dim=dims).mean()
        loss = loss + beta_kl * kl
        kl_value = kl.item()
    stats = {"policy_loss": policy.item(), "positive_loss": loss_pos.mean().item(),
             "negative_loss": loss_neg.mean().item(), "r_mean": r.mean().item(), "kl": kl_value}
    return loss, stats


def _adaptive_mse(err: torch.Tensor, dims: tuple[int, ...], floor: float) -> torch.Tensor:
    """``mean(err^2 / sg(mean|err|))`` per sample -> [B]; the weight in float64, floored."""
    with torch.no_grad():
        w = err.double().abs().mean(dim=dims, keepdim=True).clamp(min=floor).float()  # [B, 1, ...]
    return (err**2 / w).mean(dim=dims)
