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

import torch

from ..advantages import group_advantages
from ..losses import nft_loss
from ..sde import flow_interpolate
from ..seeding import stream_seed
from ..trainable import EMA
from ..types import index_cond
from .base import Update, train_epochs

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


class NFTUpdate(Update):
    """DiffusionNFT; keeps the old policy across iterations (checkpointed as ``extra["old_policy"]``)."""

    @dataclass
    class Options:
        beta: float = 1.0  # strength of the implicit positive / negative policies (DiffusionNFT beta)
        global_std: bool = False  # normalise advantages by the whole batch's std instead of the group's

        def __post_init__(self):
            if not self.beta > 0:
                raise ValueError(f"train.loss_options.beta (nft) must be > 0, got {self.beta}")

    kl_term = True  # train.beta_kl x the velocity distance to the reference
    keeps_old_policy = True

    def __init__(self, ctx, options=None):
        super().__init__(ctx, options)
        self.old_policy = None  # made on the first update (or restored from a checkpoint)

    def state_dict(self) -> dict:
        return {"old_policy": self.old_policy.shadow} if self.old_policy is not None else {}

    def load_state_dict(self, extra: dict) -> None:
        if "old_policy" in extra:
            self.old_policy = OldPolicy(self.ctx.unwrapped)
            self.old_policy.shadow = extra["old_policy"]

    def __call__(self, rollout, it: int) -> tuple[dict, dict]:
        ctx, cfg = self.ctx, self.ctx.train
        if self.old_policy is None:
            self.old_policy = OldPolicy(ctx.unwrapped)
        adv, zero = group_advantages(rollout.rewards, rollout.group_index, global_std=self.opts.global_std,
                                     clip=None)  # nft_loss clips to +-adv_clip_max (and scales by it)
        rows_all = torch.nonzero(~zero).flatten()
        dev = ctx.device
        cond_all = rollout.conditioning(ctx.policy)  # the rollout's own: prompts are not encoded again
        x0_all, adv_d, prompt_d = rollout.x0.to(dev), adv.to(dev), rollout.prompt_index.to(dev)  # once per update

        def draws(g: torch.Generator) -> dict:
            t_all = (T_MIN + (1 - T_MIN) * torch.rand(rollout.num_samples, generator=g)).to(dev)  # [N]
            return {"t": t_all, "eps": torch.randn(rollout.x0.shape, generator=g).to(dev)}  # eps [N, C, H, W]

        def loss_of(mb: torch.Tensor, d: dict) -> tuple[torch.Tensor, dict]:
            x0, t = x0_all[mb], d["t"][mb]  # [m, C, H, W], [m]
            x_t = flow_interpolate(x0, d["eps"][mb], t.view(-1, *[1] * (x0.dim() - 1)))  # [m, C, (F,) H, W]
            c = index_cond(cond_all, prompt_d[mb])
            with torch.no_grad(), self.old_policy.applied(ctx.unwrapped):
                v_old = ctx.policy.velocity(x_t, t, c)
            v_ref = None
            if cfg.beta_kl > 0:
                with torch.no_grad(), ctx.reference():
                    v_ref = ctx.policy.velocity(x_t, t, c)
            with ctx.autocast():
                v = ctx.policy.velocity(x_t, t, c)
            return nft_loss(v, v_old, x_t, x0, t, adv_d[mb], beta=self.opts.beta,
                            adv_clip_max=cfg.adv_clip_max, v_ref=v_ref, beta_kl=cfg.beta_kl)

        out, _ = train_epochs(ctx, rows_all, seed_of_epoch=lambda e: stream_seed("shuffle.nft", cfg.seed, it, e),
                              pass_size=cfg.minibatch_size, loss_of=loss_of, draws=draws,
                              after_step=lambda: self.old_policy.step(ctx.unwrapped, ctx.optimizer_steps()))
        out.update({"transitions_trained": int(len(rows_all)) * cfg.inner_epochs,
                    "zero_var_fraction": zero.float().mean().item(),
                    "nft/old_decay": OldPolicy.decay_at(ctx.optimizer_steps())})
        return out, {}
