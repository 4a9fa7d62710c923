"""Offline GDRO step (``train.mode: offline``; arXiv 2601.02036, docs/algorithms.md §8): one optimizer
step over ``train.grad_accum`` passes of reference-model groups read from the dataset, ranked by reward,
trained through implicit rewards.

A pass's loss is the mean over its ranked groups of ``PL + gamma * FM(top image)``; the shared
``(t, eps)`` of each group come from ``(train.seed, step, pass, rank)`` only (seed purpose
``offline.noise``). Each logged statistic is the mean over the finite passes that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses.gdro import gdro_loss, group_velocity_errors, implicit_rewards, ranking_stats, usable_groups
from ..seeding import stream_seed
from .base import Update, train_passes


def ranking_rewards(rewards: dict[str, torch.Tensor], weights: dict[str, float], aggregate: str) -> torch.Tensor:
    """The value groups are ranked by, ``[G, k]`` float32: the weighted sum of the reward columns
    (``aggregate='sum'``), or of each column standardised within its group first
    (``'per_reward'``, MixGRPO ``advantage_aggr``). NaN where any weighted column is NaN."""
    total = None
    for name, w in weights.items():
        if w == 0:
            continue
        r = rewards[name].float()  # [G, k]
        if aggregate == "per_reward":
            r = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)
        total = w * r if total is None else total + w * r
    return total if total is not None else torch.zeros_like(next(iter(rewards.values())))


def sample_t(generator: torch.Generator, n: int, cfg) -> torch.Tensor:
    """``[n]`` noise levels t in [t_min, t_max] by ``offline.t_sampling`` (float32)."""
    if cfg.t_sampling == "uniform":
        return cfg.t_min + (cfg.t_max - cfg.t_min) * torch.rand(n, generator=generator)
    t = torch.sigmoid(cfg.t_mean + cfg.t_std * torch.randn(n, generator=generator))  # SD3 logit-normal
    return t.clamp(cfg.t_min, cfg.t_max)


class OfflineGDROUpdate(Update):
    """``OfflineGDROUpdate(ctx, options, dataset, offline_cfg)``; ``__call__(passes, step) -> stats``
    with ``passes`` this process's ``grad_accum`` tensors of group ids."""

    @dataclass
    class Options:
        beta: float = 12.0  # implicit-reward beta (offline.beta)
        tau: float = 0.05   # Plackett-Luce target temperature (offline.tau)
        gamma: float = 0.0  # weight of the flow-matching loss on each group's top image (offline.gamma)

    def __init__(self, ctx, options=None, dataset=None, offline_cfg=None):
        super().__init__(ctx, options)
        self.ds, self.o = dataset, offline_cfg

    @classmethod
    def options_of(cls, offline_cfg) -> "OfflineGDROUpdate.Options":
        return cls.Options(beta=offline_cfg.beta, tau=offline_cfg.tau, gamma=offline_cfg.gamma)

    def noise(self, step: int, micro: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared ``(t [g], eps [g, C, H, W])`` per group, from (seed, step, pass, rank) only."""
        seed = stream_seed("offline.noise", self.ctx.train.seed, step, micro, self.ctx.process_index)
        gen = torch.Generator().manual_seed(seed)
        t = sample_t(gen, g, self.o)  # [g]
        eps = torch.randn((g, *self.ds.latent_shape), generator=gen)  # [g, C, H, W]
        return t, eps

    def pass_loss(self, groups: torch.Tensor, step: int, micro: int) -> tuple[torch.Tensor, dict]:
        """GDRO loss of one pass over ``groups`` [G] ids -> (loss scalar, stats)."""
        ctx, reward = self.ctx, self.ctx.reward
        dev = ctx.device
        batch = self.ds.read(groups, rewards=list(reward.weights))
        r = ranking_rewards(batch.rewards, reward.weights, reward.aggregate)  # [G, k]
        finite, ranked = usable_groups(r)  # [G]
        t, eps = self.noise(step, micro, len(groups))
        with torch.no_grad():
            cond = ctx.policy.encode_prompts(batch.prompts)  # G rows
        err, err_ref = group_velocity_errors(ctx.policy, ctx.reference, batch.x0.to(dev), cond, t.to(dev),
                                             eps.to(dev), autocast=ctx.autocast)  # [G, k]
        s = implicit_rewards(err, err_ref, self.opts.beta)  # [G, k]
        stats = {"ranked_fraction": float(ranked.float().mean()), "nonfinite_groups": int((~finite).sum())}
        if not ranked.any():
            return err.sum() * 0.0, stats  # keeps the graph (DDP: every rank runs backward)
        m = ranked.to(dev)
        rr = r.to(dev)[m]  # [G', k]
        pl = gdro_loss(s[m], rr, self.opts.tau)
        top = rr.argmax(dim=1)  # [G']
        reg = err[m].gather(1, top.view(-1, 1)).mean()  # flow-matching loss on each group's top image
        loss = pl + self.opts.gamma * reg
        stats.update({"pl_loss": pl.item(), "fm_top": reg.item(),
                      "fm_ref_top": err_ref[m].gather(1, top.view(-1, 1)).mean().item(), **ranking_stats(s[m], rr)})
        return loss, stats

    def __call__(self, passes: list, step: int) -> dict:
        """One optimizer step over ``passes`` -> stats (per-key means over finite passes, ``grad_norm``)."""
        return train_passes(self.ctx, list(enumerate(passes)), lambda jp: self.pass_loss(jp[1], step, jp[0]))
