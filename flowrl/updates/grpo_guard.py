"""GRPO-Guard update (``train.loss: grpo_guard``): Flow-GRPO's clipped ratio with GRPO-Guard's ratio
normalisation and per-step gradient reweighting (Wang et al., "GRPO-Guard: Mitigating Implicit
Over-Optimization in Flow Matching via Regulated Clipping", arXiv 2510.22319; docs/algorithms.md).

For a Gaussian step ``x' ~ N(mu, s^2)`` (``s``: the step's std, ``sigma_t sqrt(|dt|)``) the log-ratio
``log r = logp_theta - logp_old`` (per-element mean, as flowrl's ``log_prob``) has mean
``-||mu_theta - mu_old||^2 / (2 s^2)`` under the sampling policy: it is shifted left, more so at
small ``s``, so the clip at ``1 +- eps`` stops binding for positive advantages. GRPO-Guard:

* ratio normalisation: ``r_hat = exp(s * (log r + b))`` with ``b = mean_dims((mu_theta - mu_old)^2) / (2 s^2)``
  (equivalently ``exp(mean_dims(eps * (mu_theta - mu_old)))``, ``eps`` the step's unit noise);
* per-step reweighting: the clipped term of each transition is divided by ``|dt|`` (the peer code divides
  a one-timestep batch by ``mean(sqrt|dt|)^2``), evening out the gradient scale across steps.

``L = mean_i w_i max(-A_i r_hat_i, -A_i clip(r_hat_i, 1 - eps, 1 + eps)) / |dt_i|`` (+ the KL of ``grpo``).
``mu_old`` is the step mean under the weights at the start of the update, recomputed once per update
(no grad) before any optimizer step: the rollout does not store it. With an exploration backend
(Sol-RL's quantised rollouts) that is the full-precision policy's mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .grpo import GRPOOptions, GRPOUpdate


def guard_clipped_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                       std: torch.Tensor, dt: torch.Tensor, advantages: torch.Tensor, clip_range: float,
                       weight: Optional[torch.Tensor] = None, *, ratio_norm: bool = True, reweight: bool = True
                       ) -> tuple[torch.Tensor, dict]:
    """GRPO-Guard's surrogate (module doc), **mean** over the ``[M]`` transitions -> (loss, stats).

    ``log_prob``, ``old_log_prob``, ``std``, ``dt`` (``sigma_next - sigma``), ``advantages``, ``weight``:
    ``[M]``; ``mean``, ``old_mean``: ``[M, ...]`` step means under the current and the sampling policy.
    Rows with ``std = 0`` (deterministic) get ``r_hat = 1``. Stats (detached 0-dim tensors):
    ``clip_fraction``, ``ratio_mean`` (of ``r_hat``), ``ratio_bias`` (mean ``b``).
    """
    lr = log_prob - old_log_prob  # [M]
    s = std.float()
    if ratio_norm:
        d2 = ((mean.float() - old_mean.float()) ** 2).flatten(1).mean(dim=1)  # [M]
        ok = s > 0
        s_safe = torch.where(ok, s, torch.ones_like(s))
        bias = torch.where(ok, d2 / (2 * s_safe**2), torch.zeros_like(d2))  # [M]
        lr = torch.where(ok, (lr + bias) * s, torch.zeros_like(lr))
    else:
        bias = torch.zeros_like(lr)
    ratio = torch.exp(lr)  # [M]
    per = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    if weight is not None:
        per = per * weight
    if reweight:
        per = per / dt.float().abs()
    with torch.no_grad():
        stats = {"clip_fraction": ((ratio - 1).abs() > clip_range).float().mean(), "ratio_mean": ratio.mean(),
                 "ratio_bias": bias.mean()}
    return per.mean(), stats


class GRPOGuardUpdate(GRPOUpdate):
    """GRPO with GRPO-Guard's regulated clipping; advantages, KL and accounting as ``grpo``."""

    summary = "GRPO-Guard (arXiv 2510.22319): GRPO with ratio normalisation and per-step reweighting"

    @dataclass
    class Options(GRPOOptions):
        ratio_norm: bool = True  # re-centre and rescale the log-ratio (the RatioNorm term)
        reweight: bool = True    # divide each transition's clipped term by |dt|

    def prepare(self, rollout, cond, trans, rows: torch.Tensor) -> dict:
        """``old_mean`` [M, C, H, W]: step means under the weights before this update (no grad)."""
        if not self.opts.ratio_norm:
            return {"old_mean": torch.zeros_like(trans.next_latents)}  # never read
        return {"old_mean": self.step_means(rollout, cond, trans, rows)}

    def surrogate(self, out, tr, adv: torch.Tensor, rows: torch.Tensor, extra) -> tuple[torch.Tensor, dict]:
        dev = self.ctx.device
        return guard_clipped_loss(out.log_prob, tr.old_log_prob.to(dev), out.mean, extra["old_mean"][rows.to(dev)],
                                  out.std, (tr.sigma_next - tr.sigma).to(dev), adv, self.opts.clip_range,
                                  tr.weight.to(dev), ratio_norm=self.opts.ratio_norm, reweight=self.opts.reweight)
