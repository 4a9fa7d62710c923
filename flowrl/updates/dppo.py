"""Flow-DPPO update (``train.loss: dppo``): GRPO's rollouts, stored transitions and advantages, with a
KL trust region instead of ratio clipping (arXiv 2606.11025; UniRL ``FlowDPPO``; docs/algorithms.md §13).

Per stored transition the exact Gaussian KL between the sampling-time step ``N(mu_old, s^2)`` and the
current one ``N(mu_theta, s^2)`` (they share the step's scale ``s``) decides whether its term
``-A ratio`` is kept: a transition is dropped only when that KL is at least ``kl_threshold`` and it keeps
moving in the direction its advantage pushes (``flowrl.losses.dppo.dppo_loss``). ``mu_old`` is the step mean
under the weights at the start of the update, recomputed once before any optimizer step (no grad, as
GRPO-Guard's); ``logp_old`` is the log-prob stored at sampling. Any sampler that stores transitions
feeds it (group, branch, tempflow, sol with regen: group); the KL to the frozen reference (``beta_kl``,
off by default: the peers have none) is GRPO's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses import dppo_loss
from .base import check_number
from .grpo import GRPOUpdate, TransitionOptions


@dataclass
class DPPOOptions(TransitionOptions):
    """``train.loss_options`` of ``dppo``: GRPO's advantages and KL to the reference, and the trust region."""

    kl_threshold: float = 1e-5  # tau: a transition whose mean-reduced KL to the sampling step is >= tau and that
    #                             moves along its advantage is dropped (UniRL kl_mask_threshold, published 1e-5)
    normalise_kl: bool = True  # the KL divides the squared mean gap by 2 s^2 (UniRL add_kl_coefficient, default);
    #                            false: by 2 alone

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "kl_threshold", strict=True)
        if not isinstance(self.normalise_kl, bool):
            raise ValueError(f"train.loss_options.normalise_kl must be true or false, got {self.normalise_kl!r}")


class DPPOUpdate(GRPOUpdate):
    """Flow-DPPO: the KL-masked policy gradient on stored transitions (its knobs: :class:`DPPOOptions`)."""

    Options = DPPOOptions
    summary = "Flow-DPPO: policy gradient masked by a trust region of the exact transition KL"
    digits_recipe = "digits_dppo.yaml"

    def prepare(self, rollout, cond, trans, rows: torch.Tensor) -> dict:
        """``old_mean`` [M, C, H, W]: step means under the weights before this update (no grad)."""
        return {"old_mean": self.step_means(rollout, cond, trans, rows)}

    def surrogate(self, out, tr, adv: torch.Tensor, rows: torch.Tensor, extra) -> tuple[torch.Tensor, dict]:
        dev = self.ctx.device
        return dppo_loss(out.log_prob, tr.old_log_prob.to(dev), out.mean, extra["old_mean"][rows.to(dev)], out.std,
                         adv, kl_threshold=self.opts.kl_threshold, normalise_kl=self.opts.normalise_kl,
                         weight=tr.weight.to(dev))
