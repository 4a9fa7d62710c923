"""GRPO-family losses (docs/algorithms.md §2-3): the clipped surrogate and the KL to the reference."""
from __future__ import annotations

import torch

from ..sde import SCALE_IS_NOISE_COEFFICIENT


def grpo_clipped_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      clip_range: float, weight: torch.Tensor | None = None, *,
                      host_stats: bool = True) -> tuple[torch.Tensor, dict]:
    """PPO-clip surrogate of Flow-GRPO (arXiv 2505.05470 eq. 4), per transition.

    ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` with ``r = exp(logp - logp_old)``, times
    ``weight`` (TempFlow's noise-aware weights, else 1), **mean** over the ``[M]`` rows.
    Returns (loss scalar, stats: clip_fraction, approx_kl, ratio_mean): floats, or with
    ``host_stats=False`` detached 0-dim float32 tensors on the loss's device (no host sync here: the
    trainer reads them once per iteration).
    """
    ratio = torch.exp(log_prob - old_log_prob)  # [M]
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per = torch.maximum(unclipped, clipped)  # [M]
    if weight is not None:
        per = per * weight
    with torch.no_grad():
        stats = {"clip_fraction": ((ratio - 1).abs() > clip_range).float().mean(),
                 "approx_kl": (0.5 * (log_prob - old_log_prob) ** 2).mean(),
                 "ratio_mean": ratio.mean()}  # 0-dim each
        if host_stats:
            stats = {k: v.item() for k, v in stats.items()}
    return per.mean(), stats


KL_FORMS = ("flow_grpo", "exact")


def kl_form_for_step(form: str, step_type: str) -> str:
    """The KL form to use for a step type: Flow-GRPO's CPS ``std_dev_t`` is the step's scale itself
    (no ``sqrt(-dt)`` factor to divide out), so its code's KL there is the exact one."""
    return "exact" if form == "flow_grpo" and step_type in SCALE_IS_NOISE_COEFFICIENT else form


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, *,
                    dt: torch.Tensor | float | None = None, form: str = "flow_grpo") -> torch.Tensor:
    """KL penalty between the policy's and the reference's Gaussian step, per transition -> ``[M]``.

    Both steps share ``std`` (the step's Gaussian scale, ``StepOutput.std``, e.g. Flow-GRPO's
    ``std_t * sqrt(-dt)``); ``d2 = mean over non-batch dims of (mu - mu_ref)^2``.

    * ``form="flow_grpo"`` (Flow-GRPO, arXiv 2505.05470, as its code computes it; the default, so
      published betas carry over): ``d2 / (2 * std^2 / |dt|)``, i.e. divided by twice the squared
      noise coefficient ``std_t`` without the ``sqrt(-dt)`` factor. Needs ``dt``.
    * ``form="exact"``: ``d2 / (2 * std^2)``, the KL of the two transition Gaussians per element
      (TempFlow-GRPO's code uses this form, with betas 0.001 / 0.004). It is ``1 / |dt|`` times the
      flow_grpo value (x3.7 to x25 on SD3's first steps at T = 10).

    Args:
        mean, ref_mean: ``[M, ...]`` float32 step means under the policy and the reference.
        std: ``[M]`` step scale; rows with std 0 (deterministic steps) contribute 0.
        dt: ``[M]`` or a float, ``sigma_next - sigma`` (< 0); required by ``form="flow_grpo"``.
    Returns:
        ``[M]`` float32 (the caller averages).
    """
    if form not in KL_FORMS:
        raise ValueError(f"unknown KL form {form!r}; choose one of {KL_FORMS}")
    dims = tuple(range(1, mean.ndim))
    d2 = ((mean.float() - ref_mean.float()) ** 2).mean(dim=dims)  # [M]
    var = std.float() ** 2  # [M]
    if form == "flow_grpo":
        if dt is None:
            raise ValueError("kl_to_reference(form='flow_grpo') needs dt (sigma_next - sigma): Flow-GRPO divides by "
                             "the noise coefficient std^2 / |dt|; pass dt, or use form='exact'")
        var = var / torch.as_tensor(dt, dtype=torch.float32, device=var.device).abs().expand_as(var)  # [M]
    ok = var > 0
    safe = torch.where(ok, var, torch.ones_like(var))
    return torch.where(ok, d2 / (2 * safe), torch.zeros_like(d2))
