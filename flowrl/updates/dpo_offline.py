"""Offline Diffusion-DPO (``train.loss: dpo_offline``; Wallace et al., arXiv 2311.12908; docs/algorithms.md §16) on
a dataset of preference pairs (``data.dataset``: prompt, preferred image, rejected image, Pick-a-Pic's layout;
:mod:`flowrl.data.image_sets`; ``flowrl make-pairs`` turns a ``generate-offline`` dataset into one). Sampler-free;
the reference is the frozen base (the adapter-disabled model, or the frozen copy under a full fine-tune).

Per pair ``(x_w, x_l)`` with one shared ``(t, eps)`` (as the authors' code: the same noise and time for both
images): per-image mean squared velocity errors ``e = mean ||v - (eps - x0)||^2`` of the policy and the
reference, and the loss (eq. 14, the authors' ``-0.5 beta_dpo`` scale)::

    L = -log sigmoid(-beta / 2 * ((e_w - e_l) - (e_w_ref - e_l_ref)))

mean over the pass's pairs. ``beta`` is the authors' ``beta_dpo`` (their SD1.5 default 5000, SDXL 2500: per-element
mean errors are small); the online ``dpo`` takes ``-beta (e - e_ref)`` without the 1/2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..conditions import encode_conditions
from ..losses.gdro import dpo_loss, group_velocity_errors, implicit_rewards
from .base import Batch, Minibatch, Needs, check_number
from .image_steps import ImageStepOptions, ImageStepUpdate, encode_images


@dataclass
class DPOOfflineOptions(ImageStepOptions):
    """``train.loss_options`` of ``dpo_offline``: ``beta`` and the training times (:class:`ImageStepOptions`;
    the authors drew t uniformly: ``t_sampling: uniform``)."""

    beta: float = 5000.0  # Diffusion-DPO's beta_dpo (the loss scales the error differences by beta / 2)
    t_sampling: str = "uniform"

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "beta", strict=True)


def dpo_offline_loss(err: torch.Tensor, err_ref: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusion-DPO's loss of ``[n, 2]`` errors (column 0 preferred, 1 rejected) of the policy and the reference:
    ``(loss, implicit [n, 2])`` with ``implicit = -beta / 2 (err - err_ref)`` (so the loss is
    ``-log sigmoid(implicit_w - implicit_l)``, mean over pairs)."""
    s = implicit_rewards(err, err_ref, beta / 2)  # [n, 2]
    return dpo_loss(s[:, 0], s[:, 1]), s


class DPOOfflineUpdate(ImageStepUpdate):
    """``DPOOfflineUpdate(ctx, options)``: one call is one optimizer step over passes of ``data.dataset`` pairs."""

    Options = DPOOfflineOptions
    summary = "offline Diffusion-DPO: preferred vs rejected image pairs of a dataset (data.dataset; train.mode offline)"
    digits_recipe = "digits_dpo_offline.yaml"

    @classmethod
    def needs(cls, options) -> Needs:
        # the implicit reward compares the policy with the frozen base, beside the training graph
        return Needs(consumes="dataset", data="pairs", unit="pair", reference=True, reference_in_graph=True)

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        ctx = self.ctx
        prompts, win, lose = ctx.dataset.read(mb.rows.cpu())  # [n], [n, 3, H, W] x 2
        n = len(prompts)
        x0 = encode_images(ctx.policy, torch.cat([win, lose]))  # [2n, C, h, w]
        x0 = x0.view(2, n, *x0.shape[1:]).transpose(0, 1)  # [n, 2, C, h, w]: preferred, rejected
        t, eps = self.noise(batch.data["step"], mb.index, n, tuple(x0.shape[2:]))  # [n], [n, C, h, w]
        with torch.no_grad():
            cond = encode_conditions(ctx.policy, prompts)  # n rows
        err, err_ref = group_velocity_errors(ctx.policy, ctx.reference, x0, cond, t, eps,
                                             autocast=ctx.autocast)  # [n, 2] each
        loss, s = dpo_offline_loss(err, err_ref, self.opts.beta)
        s, e, e_ref = s.detach(), err.detach(), err_ref.detach()
        return loss, {"dpo_loss": loss.detach(), "implicit_accuracy": float((s[:, 0] > s[:, 1]).float().mean()),
                      "reward_margin": float((s[:, 0] - s[:, 1]).mean()),
                      "fm_win": float(e[:, 0].mean()), "fm_win_ref": float(e_ref[:, 0].mean())}
