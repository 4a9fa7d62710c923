"""Flow-DPPO: a KL trust region on SDE transitions instead of ratio clipping (arXiv 2606.11025;
docs/algorithms.md §13).

Every stochastic step is a Gaussian ``N(mu, s^2 I)`` whose scale ``s`` (``StepOutput.std``, e.g.
Flow-GRPO's ``std_t sqrt(-dt)``) depends on the schedule only, so the sampling-time (old) and the
current transition share it and their KL is exact and cheap. Per stored transition:

    D      = mean_dims( (mu_theta - mu_old)^2 ) / (2 s^2)      mean over latent dims (not the sum)
    ratio  = exp(logp_theta - logp_old)
    drop   = D >= tau  and  ( (ratio > 1 and A > 0) or (ratio < 1 and A < 0) )
    L      = mean( where(drop, 0, -A ratio) )

A high-KL update is dropped only when it keeps moving away from the old policy in the direction
the advantage pushes; corrective moves (e.g. ``A > 0`` with ``ratio < 1``) always pass, and so does
every low-KL one, however large its ratio. There is no ratio clipping.

``mu_old`` is the step mean under the weights before the update (the peers recompute it once at
the update's start, as flowrl's GRPO-Guard does); ``logp_old`` the log-prob stored at sampling.
Sources: UniRL ``unirl/algorithms/flowdppo.py`` (``_flowdppo_kl_adv_loss``, Tencent-Hunyuan/UniRL
1a7b501) and verl-omni ``FlowDPPOLoss`` (``verl_omni/trainer/diffusion/diffusion_algos.py``, a1139ba).
"""
from __future__ import annotations

from typing import Optional

import torch

from .grpo import kl_to_reference


def transition_kl(mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor, *,
                  normalise: bool = True) -> torch.Tensor:
    """Per-transition divergence ``D`` of Flow-DPPO -> ``[M]`` float32.

    ``normalise=True`` (the peers' ``add_kl_coefficient``, their default): the exact KL of
    ``N(mean, std^2)`` and ``N(old_mean, std^2)`` per element, averaged over the non-batch dims
    (``kl_to_reference(form="exact")``; rows with ``std`` 0 give 0). ``normalise=False``:
    ``mean_dims((mean - old_mean)^2) / 2``.

    Args:
        mean, old_mean: ``[M, ...]`` step means under the current and the old weights.
        std: ``[M]`` the step's Gaussian scale (``StepOutput.std``).
    """
    if normalise:
        return kl_to_reference(mean, old_mean, std, form="exact")
    return (mean.float() - old_mean.float()).pow(2).flatten(1).mean(dim=1) / 2


def dppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
              std: torch.Tensor, advantages: torch.Tensor, *, kl_threshold: float = 1e-5, normalise_kl: bool = True,
              weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's KL-masked policy-gradient loss over ``[M]`` stored transitions (module doc).

    Args:
        log_prob: ``[M]`` log-prob of the stored next latent under the current policy (gradient).
        old_log_prob: ``[M]`` the same under the sampling policy (stored at sampling).
        mean: ``[M, ...]`` current step mean (gradient flows only through ``log_prob``; the mask
            is not differentiated).
        old_mean: ``[M, ...]`` step mean under the weights before the update.
        std: ``[M]`` the step's scale ``StepOutput.std``.
        advantages: ``[M]`` per-transition advantages (already clipped as the caller wants).
        kl_threshold: ``tau``, compared with the mean-reduced ``D`` (published: 1e-5).
        normalise_kl: divide by ``2 s^2`` (True) or by 2 only (the peers' ``add_kl_coefficient``).
        weight: optional ``[M]`` per-transition weights (multiplies the kept terms).
    Returns:
        ``(loss, stats)``: loss the mean over ``[M]``; stats detached 0-dim float32 tensors
        ``masked_fraction``, ``pos_rm_fraction``, ``neg_rm_fraction``, ``high_kl_fraction``,
        ``kl_mean``, ``kl_max``, ``ratio_mean``, ``approx_kl``.
    """
    if not kl_threshold > 0:
        raise ValueError(f"dppo_loss: kl_threshold must be > 0, got {kl_threshold}")
    m = log_prob.shape[0]
    if old_log_prob.shape != (m,) or advantages.shape != (m,) or std.shape != (m,) or mean.shape != old_mean.shape:
        raise ValueError(f"dppo_loss: log_prob, old_log_prob, advantages, std must be [{m}] and mean match old_mean")
    log_ratio = log_prob.float() - old_log_prob.float()  # [M]
    ratio = torch.exp(log_ratio)
    adv = advantages.float().detach()
    with torch.no_grad():
        kl = transition_kl(mean.detach(), old_mean, std, normalise=normalise_kl)  # [M]
        high = kl >= kl_threshold
        pos_rm = high & (ratio > 1.0) & (adv > 0)
        neg_rm = high & (ratio < 1.0) & (adv < 0)
        keep = ~(pos_rm | neg_rm)  # [M]
    per = torch.where(keep, -adv * ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device))  # [M]
    if weight is not None:
        per = per * weight.float()
    with torch.no_grad():
        stats = {"masked_fraction": (~keep).float().mean(), "pos_rm_fraction": pos_rm.float().mean(),
                 "neg_rm_fraction": neg_rm.float().mean(), "high_kl_fraction": high.float().mean(),
                 "kl_mean": kl.mean(), "kl_max": kl.max(), "ratio_mean": ratio.mean(),
                 "approx_kl": (0.5 * log_ratio**2).mean()}
    return per.mean(), stats
