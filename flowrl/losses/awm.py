"""AWM, Advantage Weighted Matching (Xue et al., arXiv 2509.25050; docs/algorithms.md §11).

AWM trains on finished samples with the pretraining flow-matching loss, weighted by advantages
through a PPO-style clipped ratio. For a clean sample ``x0``, a training time ``sigma`` and
noise ``eps`` (the caller builds ``x_t = (1 - sigma) x0 + sigma eps`` and runs the models there):

    e        = mean_dims( (v_theta(x_t) - (eps - x0))^2 )            per-sample matching error
    logp     = w(e, sigma)                                            the "log-probability" (weighting below)
    ratio    = exp(logp - logp_old)                                   logp_old: the sampling policy's, no grad
    A        = clip(A, adv_lo, adv_hi) * adv_scale
    L_pg     = mean( max(-A ratio, -A clip(ratio, 1 + clip_lo, 1 + clip_hi)) )
    L        = L_pg + beta_kl mean(mean_dims((v_theta - v_ref)^2)) + beta_ema_kl mean(mean_dims((v_theta - v_ema)^2))

Weightings ``w`` (Flow-Factory ``AWMTrainer.compute_weighted_log_prob``, commit a0b2bc5; the
official ``compute_log_prob_awm``, scxue/advantage_weighted_matching be51372), with ``e`` the error:

    uniform  -e
    t        -e sigma
    t2       -e sigma^2
    huber    -(sqrt(e + 1e-10) - 1e-5) sigma
    ghuber   -((e + 1e-10)^p - (1e-10)^p) sigma / p          p = ghuber_power (0.25 published)

The error and the weighting run in float64 (as both peers), the result is float32. Means run over
the non-batch dims per sample, then over the batch rows (rows may carry different times: the
official code's ``exp_first`` loss over ``T x B`` rows is the mean over all of them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..errors import ConfigError
from .flow_matching import clip_pair, velocity_mse

AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
_EPS = 1e-10  # inside the huber roots (both peers)


@dataclass(frozen=True)
class AWMOptions:
    """AWM's loss settings. Defaults are Flow-Factory's ``AWMTrainingArguments``; the published
    recipes (SD3.5-M and FLUX) use ``weighting="ghuber"``, ``clip_range=1``, ``adv_clip=1`` (§11).

    ``clip_range``: ratio clip as offsets from 1 (scalar ``c`` -> ``[1 - c, 1 + c]``).
    ``adv_clip``: advantage clip (scalar ``c`` -> ``[-c, c]``), applied before ``adv_scale``.
    ``adv_scale``: multiplies the clipped advantage; the official code's ``advantage_max /
    adv_clip_max`` (``1 / 5`` in its recipes, with ``adv_clip=5``); Flow-Factory has none (1).
    ``beta_kl`` / ``beta_ema_kl``: weights of the velocity-space distances to the reference and
    to the EMA copy.
    """

    weighting: str = "uniform"
    ghuber_power: float = 0.25
    clip_range: Union[float, tuple] = (-1e-4, 1e-4)
    adv_clip: Union[float, tuple] = (-5.0, 5.0)
    adv_scale: float = 1.0
    beta_kl: float = 0.0
    beta_ema_kl: float = 0.0

    def __post_init__(self):
        if self.weighting not in AWM_WEIGHTINGS:
            raise ConfigError(f"unknown AWM weighting {self.weighting!r}; choose one of {AWM_WEIGHTINGS}")
        if not self.ghuber_power > 0:
            raise ConfigError(f"AWM ghuber_power must be > 0, got {self.ghuber_power!r}")
        if not self.adv_scale > 0:
            raise ConfigError(f"AWM adv_scale must be > 0, got {self.adv_scale!r}")
        if self.beta_kl < 0 or self.beta_ema_kl < 0:
            raise ConfigError(f"AWM beta_kl and beta_ema_kl must be >= 0, got {self.beta_kl!r}, {self.beta_ema_kl!r}")
        object.__setattr__(self, "clip_range", clip_pair(self.clip_range, "AWM clip_range"))
        object.__setattr__(self, "adv_clip", clip_pair(self.adv_clip, "AWM adv_clip"))


def awm_log_prob(v_theta: torch.Tensor, v_target: torch.Tensor, sigma: torch.Tensor,
                 weighting: str = "uniform", ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's weighted matching log-probability (module doc) -> ``[B]`` float32.

    Args:
        v_theta: ``[B, ...]`` velocity of the model at ``x_t``; gradient flows through it.
        v_target: ``[B, ...]`` the flow-matching target ``eps - x0``.
        sigma: ``[B]`` training times in ``[0, 1]`` (Flow-Factory's ``t / 1000``).
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {AWM_WEIGHTINGS}")
    err = (v_theta.double() - v_target.double()).pow(2).flatten(1).mean(dim=1)  # [B], float64
    s = sigma.double().reshape(-1)  # [B]
    if weighting == "uniform":
        logp = -err
    elif weighting == "t":
        logp = -err * s
    elif weighting == "t2":
        logp = -err * s**2
    elif weighting == "huber":
        logp = -(torch.sqrt(err + _EPS) - 1e-5) * s
    else:
        p = float(ghuber_power)
        floor = torch.tensor(_EPS, dtype=torch.float64, device=err.device)
        logp = -(torch.pow(err + floor, p) - torch.pow(floor, p)) * s / p
    return logp.float()


def awm_loss(v_theta: torch.Tensor, v_target: torch.Tensor, sigma: torch.Tensor, old_log_prob: torch.Tensor,
             advantages: torch.Tensor, options: AWMOptions, *, v_ref: Optional[torch.Tensor] = None,
             v_ema: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM loss of one batch of rows (module doc; Flow-Factory ``AWMTrainer.optimize``, a0b2bc5).

    Args:
        v_theta: ``[B, ...]`` current policy velocity at ``x_t = (1 - sigma) x0 + sigma eps``.
        v_target: ``[B, ...]`` ``eps - x0``.
        sigma: ``[B]`` training times.
        old_log_prob: ``[B]`` :func:`awm_log_prob` of the sampling policy's velocity at the same
            ``(x_t, sigma)`` with the same weighting, computed without gradient before the batch
            is trained (on-policy: the weights that sampled; ``off_policy``: the EMA weights).
        advantages: ``[B]`` group advantages of the finished samples (unclipped).
        v_ref: ``[B, ...]`` reference velocity, required when ``options.beta_kl > 0``.
        v_ema: ``[B, ...]`` EMA-copy velocity, required when ``options.beta_ema_kl > 0``.
    Returns:
        ``(loss, stats)``: loss a float32 scalar; stats detached 0-dim float32 tensors
        ``policy_loss``, ``ratio_mean``, ``clip_frac_high``, ``clip_frac_low``, ``kl``, ``ema_kl``.
    """
    b = v_theta.shape[0]
    if v_target.shape != v_theta.shape or sigma.shape != (b,) or old_log_prob.shape != (b,) or advantages.shape != (b,):
        raise ValueError(f"awm_loss: v_theta and v_target must match ({tuple(v_theta.shape)} vs {tuple(v_target.shape)}) "
                         f"and sigma, old_log_prob, advantages be [{b}]")
    log_prob = awm_log_prob(v_theta, v_target, sigma, options.weighting, options.ghuber_power)  # [B]
    lo, hi = options.adv_clip
    adv = advantages.float().clamp(lo, hi) * options.adv_scale  # [B]
    ratio = torch.exp(log_prob - old_log_prob.float().detach())  # [B]
    c_lo, c_hi = options.clip_range
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 + c_lo, 1.0 + c_hi)
    policy = torch.maximum(unclipped, clipped).mean()
    loss = policy
    zero = torch.zeros((), device=policy.device)
    kl, ema_kl = zero, zero
    if options.beta_kl > 0:
        kl = _distance("beta_kl", "v_ref", v_theta, v_ref)
        loss = loss + options.beta_kl * kl
    if options.beta_ema_kl > 0:
        ema_kl = _distance("beta_ema_kl", "v_ema", v_theta, v_ema)
        loss = loss + options.beta_ema_kl * ema_kl
    with torch.no_grad():
        stats = {"policy_loss": policy.detach(), "ratio_mean": ratio.mean(),
                 "clip_frac_high": (ratio > 1.0 + c_hi).float().mean(),
                 "clip_frac_low": (ratio < 1.0 + c_lo).float().mean(),
                 "kl": kl.detach(), "ema_kl": ema_kl.detach()}
    return loss, stats


def _distance(weight: str, name: str, v_theta: torch.Tensor, other: Optional[torch.Tensor]) -> torch.Tensor:
    """``mean over rows of mean_dims((v_theta - other)^2)``, ``other`` without gradient -> scalar."""
    if other is None:
        raise ValueError(f"awm_loss: options.{weight} > 0 needs {name}")
    return velocity_mse(v_theta, other.detach()).mean()
