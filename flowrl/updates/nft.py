"""DiffusionNFT update (``train.loss: nft``; arXiv 2509.16117, Sol-RL's trainer, docs/algorithms.md §7):
trains on finished samples alone (``Rollout.x0`` and rewards), no log-probs, so any sampler works,
ODE included.

The old (sampling) policy is a second copy of the trained tensors (LoRA: a few MB), updated after
every optimizer step as ``old <- d old + (1 - d) theta`` with ``d = min(0.001 * step, 0.5)``.
Each sample is trained at one ``t ~ U(t_min, 1)`` with fresh noise per epoch, both derived from
``(seed, iteration, epoch)`` (seed purpose ``shuffle.nft``) so resume stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses import nft_loss
from ..sde import flow_interpolate
from ..trainable import EMA
from ..types import index_cond
from .base import Batch, Minibatch, Needs, Update, UpdateOptions, check_number
from .rewards import sample_advantages as reward_advantages

T_MIN = 0.02


class OldPolicy(EMA):
    """The decayed copy of the trained tensors that defines ``v_old``: an EMA whose decay grows
    with the optimizer step, ``d = min(0.001 * step, 0.5)`` (DiffusionNFT)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module, decay=0.0)

    @staticmethod
    def decay_at(optimizer_steps: int) -> float:
        return min(0.001 * optimizer_steps, 0.5)

    def step(self, module: torch.nn.Module, optimizer_steps: int) -> None:
        self.update(module, self.decay_at(optimizer_steps))


@dataclass
class NFTOptions(UpdateOptions):
    """``train.loss_options`` of ``nft``."""

    beta: float = 1.0  # strength of the implicit positive / negative policies (DiffusionNFT beta)
    global_std: bool = False  # normalise advantages by the whole batch's std instead of the group's
    adv_clip_max: float = 5.0  # advantages are clipped to +-this, and the loss scaled by it (Amax)
    beta_kl: float = 0.0  # weight of the velocity-space KL mean((v_theta - v_ref)^2) to the reference
    moved: ClassVar[dict[str, str]] = {"train.nft_beta": "beta", "train.global_std": "global_std",
                                       "train.adv_clip_max": "adv_clip_max", "train.beta_kl": "beta_kl"}

    def __post_init__(self):
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"train.loss_options.beta (nft) must be > 0, got {self.beta}")
        check_number(self, "adv_clip_max", strict=True)
        check_number(self, "beta_kl")


class NFTUpdate(Update):
    """DiffusionNFT; keeps the old policy across iterations (checkpointed as ``extra["old_policy"]``)."""

    Options = NFTOptions
    summary = "DiffusionNFT (arXiv 2509.16117): positive / negative velocity contrast on finished samples"

    @classmethod
    def needs(cls, options) -> Needs:
        # the reference and the old policy are evaluated before the trained forward (no graph held); its group
        # advantages follow reward.aggregate (flowrl.updates.rewards)
        return Needs(clean_samples=True, reference=options.beta_kl > 0, per_reward=True, copies=("old_policy",),
                     unit="sample")

    def __init__(self, ctx, options=None):
        super().__init__(ctx, options)
        self.old_policy = None  # made on the first update (or restored from a checkpoint)

    def state_dict(self) -> dict:
        return {"old_policy": self.old_policy.shadow} if self.old_policy is not None else {}

    def load_state_dict(self, extra: dict) -> None:
        if "old_policy" in extra:
            self.old_policy = OldPolicy(self.ctx.unwrapped)
            self.old_policy.shadow = extra["old_policy"]

    def batch(self, rollout, it: int) -> Batch:
        """The samples of the groups with reward variance, their advantages and conditioning; each epoch
        draws one ``t`` and one noise per sample."""
        ctx = self.ctx
        if self.old_policy is None:
            self.old_policy = OldPolicy(ctx.unwrapped)
        adv, zero, adv_stats = self.sample_advantages(rollout)
        dev = ctx.device

        def draws(g: torch.Generator) -> dict:
            t_all = (T_MIN + (1 - T_MIN) * torch.rand(rollout.num_samples, generator=g)).to(dev)  # [N]
            return {"t": t_all, "eps": torch.randn(rollout.x0.shape, generator=g).to(dev)}  # eps [N, C, H, W]

        data = {"cond": rollout.conditioning(ctx.policy),  # the rollout's own: prompts are not encoded again
                "x0": rollout.x0.to(dev), "adv": adv.to(dev), "prompt": rollout.prompt_index.to(dev)}  # once per call
        return Batch(torch.nonzero(~zero).flatten(), ctx.train.minibatch_size, shuffle="shuffle.nft", draws=draws,
                     data=data, stats={"zero_var_fraction": zero.float().mean().item(), **adv_stats})

    def sample_advantages(self, rollout) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``(A [N], zero_var [N] bool, stats)``: group-normalised rewards under ``reward.aggregate``, unclipped
        (``nft_loss`` clips to ``+-adv_clip_max`` and scales by it), and each reward's share; zero-variance groups
        train nothing."""
        return reward_advantages(self.ctx, rollout, global_std=self.opts.global_std)

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        ctx, opts, d = self.ctx, self.opts, batch.data
        x0, t = d["x0"][mb.rows], mb.draws["t"][mb.rows]  # [m, C, H, W], [m]
        x_t = flow_interpolate(x0, mb.draws["eps"][mb.rows], t.view(-1, *[1] * (x0.dim() - 1)))  # [m, C, (F,) H, W]
        c = index_cond(d["cond"], d["prompt"][mb.rows])
        with torch.no_grad(), self.old_policy.applied(ctx.unwrapped):
            v_old = ctx.policy.velocity(x_t, t, c)
        v_ref = None
        if opts.beta_kl > 0:
            with torch.no_grad(), ctx.reference():
                v_ref = ctx.policy.velocity(x_t, t, c)
        with ctx.autocast():
            v = ctx.policy.velocity(x_t, t, c)
        return self.objective(v, v_old, x_t, x0, t, d["adv"][mb.rows], v_ref, mb.rows)

    def objective(self, v, v_old, x_t, x0, t, adv, v_ref, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The minibatch's loss from its velocities (``nft_loss``; ``v_ref`` None without a KL) -> (loss, stats)."""
        opts = self.opts
        return nft_loss(v, v_old, x_t, x0, t, adv, beta=opts.beta, adv_clip_max=opts.adv_clip_max, v_ref=v_ref,
                        beta_kl=opts.beta_kl)

    def after_step(self, optimizer_steps: int) -> None:
        self.old_policy.step(self.ctx.unwrapped, optimizer_steps)

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        return {"transitions_trained": trained, "nft/old_decay": OldPolicy.decay_at(optimizer_steps)}
