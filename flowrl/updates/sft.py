"""Supervised fine-tuning (``train.loss: sft``, or ``train.mode: sft``; docs/algorithms.md §15): the flow-matching
loss on a dataset of images with prompts (``data.dataset``, :mod:`flowrl.data.image_sets`), LoRA or full.

Per image ``x0`` (the policy's latents of the dataset image), time ``t`` (the options' sampling: logit-normal by
default, as SD3 and the digits base were pretrained) and noise ``eps``: ``x_t = (1 - t) x0 + t eps``, the
rectified-flow target ``v* = eps - x0``, loss ``mean ||v_theta(x_t, t) - v*||^2`` (uniform weighting; mean over
the pass's images and every latent element; Esser et al., arXiv 2403.03206). No reward model, no reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..conditions import encode_conditions
from ..losses.gdro import flow_matching_error
from .base import Batch, Minibatch, Needs
from .flow_matching import noised
from .image_steps import ImageStepOptions, ImageStepUpdate, encode_images


@dataclass
class SFTOptions(ImageStepOptions):
    """``train.loss_options`` of ``sft``: the training times (:class:`ImageStepOptions`)."""


class SFTUpdate(ImageStepUpdate):
    """``SFTUpdate(ctx, options)``: one call is one optimizer step over passes of ``data.dataset`` images."""

    Options = SFTOptions
    summary = "SFT: supervised flow matching on a dataset of images with prompts (data.dataset; train.mode sft)"
    digits_recipe = "digits_sft.yaml"

    @classmethod
    def needs(cls, options) -> Needs:
        return Needs(consumes="dataset", data="images", unit="sample")

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        ctx = self.ctx
        prompts, images = ctx.dataset.read(mb.rows.cpu())  # [n], [n, 3, H, W]
        x0 = encode_images(ctx.policy, images)  # [n, C, H, W]
        t, eps = self.noise(batch.data["step"], mb.index, len(x0), tuple(x0.shape[1:]))  # [n], [n, C, H, W]
        xt, target = noised(x0, eps, t)  # [n, C, H, W] each
        with torch.no_grad():
            cond = encode_conditions(ctx.policy, prompts)
        with ctx.autocast():
            v = ctx.policy.velocity(xt, t, cond)  # [n, C, H, W] float32
        err = flow_matching_error(v, target)  # [n]
        loss = err.mean()
        return loss, {"fm_loss": loss.detach(), "t_mean": float(t.mean())}
