"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang, arXiv 2510.08425, ICLR 2026;
docs/algorithms.md §12).

DGPO trains on finished (ODE) samples. A group of samples of one prompt is split by advantage
into a better and a worse half; the policy maximises the likelihood that the better group is
preferred, with each sample's implicit reward measured by its denoising (flow-matching) error
against a reference. Per sample ``i`` of group ``g`` at one training time (``x_t``, ``eps``
shared by the group in the published setting):

    d_i     = mean_dims( (v_theta - (eps - x0))^2 )                 DSM error of the policy
    d_ref_i = mean_dims( (v_refdgpo - (eps - x0))^2 )               of the DGPO reference (no grad)
    S_g     = beta_dpo / G * sum_{i in g} A_i (sg(d_i) - d_ref_i)   G: the configured group size
    L_dgpo  = mean_i( sg(sigmoid(S_{g(i)})) * A_i * d~_i )

``L_dgpo`` is the gradient surrogate of the group objective ``sum_g softplus(S_g)``
(``= -log sigmoid(R(G+) - R(G-))`` with ``R`` the advantage-weighted implicit rewards): its
gradient is ``G / (beta_dpo B)`` times that objective's (B rows). ``A_i`` is the clipped advantage.

PPO-style clip on the DSM error, against the EMA "old" policy ``v_old``: with
``ratio_i = exp(d_old_i - sg(d_i))``, a sample is clipped when ``A_i > 0 and ratio_i > 1 + clip_hi``
or ``A_i <= 0 and ratio_i < 1 + clip_lo``; a clipped sample's ``d~_i = sg(d_i)`` (no gradient),
otherwise ``d~_i = d_i`` (``clip_dsm``). The KL term ``beta_kl mean(mean_dims((v_theta - v_ref)^2))``
may be clipped by the same mask (``clip_kl``).

The DGPO reference is the frozen model ``v_ref`` (default) or the EMA old policy ``v_old``
(``use_ema_ref``, the "dynamic reference" of TDM-R1, arXiv 2603.07700, that DGPO's repository
ships); the KL always measures against ``v_ref``.

Sources: Flow-Factory ``trainers/dgpo.py`` (commit a0b2bc5) and the official
``scripts/train_sd3_dgpo.py`` (Luo-Yihong/DGPO 01ceb4b, ``compute_group_dgpo_loss_allreduce``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..errors import ConfigError
from .flow_matching import clip_pair, velocity_mse


@dataclass(frozen=True)
class DGPOOptions:
    """DGPO's loss settings; defaults are Flow-Factory's ``DGPOTrainingArguments`` (a0b2bc5).

    ``group_size``: the configured number of samples per prompt ``G`` (the divisor of ``S_g``;
    not the number of a group's rows in the batch). ``clip_range``: DSM-ratio clip as offsets
    from 1 (scalar ``c`` -> ``[1 - c, 1 + c]``). ``adv_clip``: advantage clip (scalar ``c`` ->
    ``[-c, c]``). ``use_ema_ref``: the DGPO reference is ``v_old`` instead of ``v_ref``.
    """

    group_size: int = 24
    beta_dpo: float = 100.0
    clip_range: Union[float, tuple] = (-1e-4, 1e-4)
    adv_clip: Union[float, tuple] = (-5.0, 5.0)
    clip_dsm: bool = True
    clip_kl: bool = False
    use_ema_ref: bool = False
    beta_kl: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.group_size, int) and self.group_size >= 2):
            raise ConfigError(f"DGPO group_size must be an integer >= 2 (samples per prompt), got {self.group_size!r}")
        if not self.beta_dpo > 0:
            raise ConfigError(f"DGPO beta_dpo must be > 0, got {self.beta_dpo!r}")
        if self.beta_kl < 0:
            raise ConfigError(f"DGPO beta_kl must be >= 0, got {self.beta_kl!r}")
        object.__setattr__(self, "clip_range", clip_pair(self.clip_range, "DGPO clip_range"))
        object.__setattr__(self, "adv_clip", clip_pair(self.adv_clip, "DGPO adv_clip"))

    @property
    def needs_old(self) -> bool:
        """Whether :func:`dgpo_loss` needs the EMA old policy's velocity ``v_old``."""
        return self.clip_dsm or self.clip_kl or self.use_ema_ref


def dsm_clip_mask(dsm: torch.Tensor, old_dsm: torch.Tensor, advantages: torch.Tensor,
                  clip_range: tuple[float, float]) -> torch.Tensor:
    """DGPO's PPO-style clip decision on the DSM ratio ``exp(old_dsm - dsm)`` -> ``[B]`` bool.

    One-sided by the advantage's sign: ``A > 0`` clips a ratio above ``1 + hi`` (the sample is
    already fitted better than by the old policy), ``A <= 0`` one below ``1 + lo``.
    """
    ratio = torch.exp(old_dsm.float() - dsm.detach().float())  # [B]
    lo, hi = clip_range
    return torch.where(advantages > 0, ratio > 1.0 + hi, ratio < 1.0 + lo)


def group_sums(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` [B] per group id ``group_index`` [B] (dense ``0..G-1``) -> ``[G]``."""
    out = torch.zeros(int(group_index.max()) + 1, dtype=values.dtype, device=values.device)
    return out.scatter_add_(0, group_index, values)


def dgpo_loss(v_theta: torch.Tensor, v_target: torch.Tensor, advantages: torch.Tensor, group_index: torch.Tensor,
              options: DGPOOptions, *, v_ref: Optional[torch.Tensor] = None, v_old: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DGPO loss of one batch at one training time (module doc).

    Args:
        v_theta: ``[B, ...]`` policy velocity at ``x_t = (1 - sigma) x0 + sigma eps`` (gradient).
        v_target: ``[B, ...]`` ``eps - x0``.
        advantages: ``[B]`` group advantages of the finished samples (unclipped).
        group_index: ``[B]`` long, dense group id of each row. Every group must be whole in the
            batch (the peers' batch geometry guarantees it; across ranks they sum the partial
            ``S_g`` with an all-reduce, which is the sum over the whole group).
        v_ref: ``[B, ...]`` frozen reference velocity (no grad): the DGPO reference unless
            ``use_ema_ref``, and the KL's; required when used.
        v_old: ``[B, ...]`` EMA old-policy velocity (no grad); required when ``options.needs_old``.
    Returns:
        ``(loss, stats)``: stats detached 0-dim float32 tensors ``dgpo_loss``, ``dsm``,
        ``group_weight_mean``, ``preference_loss`` (``mean_g softplus(S_g)``), ``clip_fraction``, ``kl``.
    """
    b = v_theta.shape[0]
    if v_target.shape != v_theta.shape or advantages.shape != (b,) or group_index.shape != (b,):
        raise ValueError(f"dgpo_loss: v_theta and v_target must match ({tuple(v_theta.shape)} vs "
                         f"{tuple(v_target.shape)}); advantages and group_index must be [{b}]")
    o = options
    if o.needs_old and v_old is None:
        raise ValueError("dgpo_loss: clip_dsm, clip_kl or use_ema_ref needs v_old (the EMA old policy's velocity)")
    if (not o.use_ema_ref or o.beta_kl > 0) and v_ref is None:
        raise ValueError("dgpo_loss: the frozen reference's velocity v_ref is needed (DGPO reference or KL)")
    adv = advantages.float().clamp(*o.adv_clip)  # [B]
    dsm = velocity_mse(v_theta, v_target)  # [B], with gradient
    clip = torch.zeros(b, dtype=torch.bool, device=dsm.device)
    if o.needs_old:
        clip = dsm_clip_mask(dsm, velocity_mse(v_old.detach(), v_target), adv, o.clip_range)  # [B]
    dsm_used = torch.where(clip, dsm.detach(), dsm) if o.clip_dsm else dsm  # [B]
    ref = v_old if o.use_ema_ref else v_ref
    with torch.no_grad():
        ref_dsm = velocity_mse(ref.detach(), v_target)  # [B]
        s = group_sums(adv * o.beta_dpo * (dsm.detach() - ref_dsm) / o.group_size, group_index)  # [G]
        weight = torch.sigmoid(s)[group_index]  # [B]
    policy = (weight * adv * dsm_used).mean()
    loss = policy
    kl = torch.zeros((), device=dsm.device)
    if o.beta_kl > 0:
        kl_rows = velocity_mse(v_theta, v_ref.detach())  # [B]
        if o.clip_kl:
            kl_rows = torch.where(clip, kl_rows.detach(), kl_rows)
        kl = kl_rows.mean()
        loss = loss + o.beta_kl * kl
    with torch.no_grad():
        stats = {"dgpo_loss": policy.detach(), "dsm": dsm.mean(), "group_weight_mean": weight.mean(),
                 "preference_loss": torch.nn.functional.softplus(s).mean(),
                 "clip_fraction": clip.float().mean(), "kl": kl.detach()}
    return loss, stats
