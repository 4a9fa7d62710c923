"""On-policy distillation's per-step KL (Diffusion-OPD, Li et al., arXiv 2605.15055).

The student samples a trajectory; at every state ``x_t`` it visited, its transition ``N(mu_s, s^2 I)`` and a frozen
teacher's ``N(mu_k, s^2 I)`` share the step's scale ``s`` (the sampler's step function with the same
``noise_level``: the scale depends on the schedule alone), so the reverse KL of the two Gaussians is closed form,

    KL(p_s || p_k) = ||mu_s - mu_k||^2 / (2 s^2)

(the mean over elements here, as flowrl's log-probs: ``flowrl.losses.grpo.kl_to_reference``, whose ``form`` also
offers Flow-GRPO's ``s^2 / |dt|`` denominator). Its gradient is analytic: no log-prob ratio, no advantage, no reward.
A deterministic step (``s = 0``, an ODE transition) takes the paper's mean-matching limit ``||mu_s - mu_k||^2 / 2``
(arXiv 2605.15055 eq. 12). Several teachers: ``sum_k w_k KL_k / sum_k w_k`` over the teachers of each transition.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .grpo import kl_to_reference


def opd_kl(mean: torch.Tensor, teacher_means: Sequence[torch.Tensor], weights, std: torch.Tensor, *,
           dt: Optional[torch.Tensor] = None, form: str = "exact") -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted per-step KL of the student's step to the teachers' (module doc).

    Args:
        mean: ``[M, ...]`` float32 student step means (differentiable).
        teacher_means: K tensors ``[M, ...]``, each teacher's step means at the same states (no grad).
        weights: ``[K]`` (K floats) or ``[K, M]`` (per transition: 0 where a teacher does not supervise it), >= 0;
            normalised over the teachers of each transition (a transition no teacher supervises contributes 0).
        std: ``[M]`` the step's scale (rows with 0, deterministic steps: the mean gap over 2).
        dt: ``[M]`` ``sigma_next - sigma``, for ``form="flow_grpo"``.
    Returns:
        (``[M]`` the weighted KL per transition, ``[K, M]`` each teacher's KL), float32.
    """
    ode = std.float() == 0  # [M]
    per = torch.stack([torch.where(ode, ((mean.float() - tm.float()) ** 2).flatten(1).mean(dim=1) / 2,
                                   kl_to_reference(mean, tm, std, dt=dt, form=form))
                       for tm in teacher_means])  # [K, M]
    w = torch.as_tensor(weights, dtype=torch.float32, device=per.device)
    w = (w[:, None] if w.dim() == 1 else w).expand_as(per)  # [K, M]
    total = w.sum(dim=0)  # [M]
    return (w * per).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total)), per
