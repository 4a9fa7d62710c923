"""Offline GDRO step (``train.mode: offline``, ``train.loss: offline_gdro``; arXiv 2601.02036,
docs/algorithms.md §8): one call is one optimizer step over ``train.grad_accum`` passes of reference-model
groups read from the dataset (``UpdateContext.dataset``), ranked by reward, trained through implicit rewards.

A pass's loss is the mean over its ranked groups of ``PL + gamma * FM(top image)``; the shared
``(t, eps)`` of each group come from ``(train.seed, step, pass, rank)`` only (seed purpose
``offline.noise``). Each logged statistic is the mean over the finite passes that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..advantages.aggregate import variance_shares
from ..advantages.ranking import ranking_contributions, ranking_values
from ..conditions import encode_conditions
from ..losses.gdro import gdro_loss, group_velocity_errors, implicit_rewards, ranking_stats, usable_groups
from ..seeding import stream_seed
from .base import Batch, Minibatch, Needs, Update, UpdateOptions


def sample_t(generator: torch.Generator, n: int, cfg) -> torch.Tensor:
    """``[n]`` noise levels t in [t_min, t_max] by ``cfg.t_sampling`` (float32; ``cfg``: the Options)."""
    if cfg.t_sampling == "uniform":
        return cfg.t_min + (cfg.t_max - cfg.t_min) * torch.rand(n, generator=generator)
    t = torch.sigmoid(cfg.t_mean + cfg.t_std * torch.randn(n, generator=generator))  # SD3 logit-normal
    return t.clamp(cfg.t_min, cfg.t_max)


T_SAMPLING = ("uniform", "logit_normal")


@dataclass
class OfflineGDROOptions(UpdateOptions):
    """``train.loss_options`` of ``offline_gdro`` (GDRO paper: k = 6, tau = 0.05, beta = 12 for OCR / 6 for
    GenEval, gamma = 0.5 / 1.0)."""

    beta: float = 12.0   # implicit-reward scale beta
    tau: float = 0.05    # temperature of the soft ranking targets softmax(r / tau); 0 = hard ranking
    gamma: float = 0.5   # weight of the flow-matching regulariser on each group's top image
    t_sampling: str = "uniform"  # shared noise level t: 'uniform' on [t_min, t_max] or 'logit_normal'
    t_min: float = 0.02  # smallest t
    t_max: float = 0.98  # largest t
    t_mean: float = 0.0  # logit-normal location
    t_std: float = 1.0   # logit-normal scale (sigmoid of N(t_mean, t_std), clipped to [t_min, t_max])
    moved: ClassVar[dict[str, str]] = {f"offline.{k}": k for k in ("beta", "tau", "gamma", "t_sampling", "t_min",
                                                                    "t_max", "t_mean", "t_std")}

    def __post_init__(self):
        super().__post_init__()
        for name in ("tau", "beta", "gamma", "t_std"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"train.loss_options.{name} must be a number >= 0, got {v!r}")
        if not self.beta > 0:
            raise ValueError(f"train.loss_options.beta must be > 0 (it scales the implicit rewards), got {self.beta}")
        check_times(self)


def check_times(opts) -> None:
    """The training-time options of a dataset update (``t_sampling``, ``t_min``, ``t_max``), one line each."""
    if opts.t_sampling not in T_SAMPLING:
        raise ValueError(f"train.loss_options.t_sampling must be one of {', '.join(T_SAMPLING)}, "
                         f"got {opts.t_sampling!r}")
    if not 0 < opts.t_min < opts.t_max < 1:
        raise ValueError(f"train.loss_options.t_min / t_max must satisfy 0 < t_min < t_max < 1, got "
                         f"{opts.t_min}, {opts.t_max}")


def step_batch(passes: list, step: int) -> Batch:
    """A dataset update's optimizer step: its passes in their order (no shuffle: the trainer's dataset order
    decides), the step number kept for the passes' noise."""
    return Batch(torch.cat(list(passes)), len(passes[0]), shuffle=None, data={"step": step})


def pass_noise(ctx, opts, step: int, micro: int, n: int, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t [n], eps [n, *shape])`` of pass ``micro`` of optimizer step ``step`` on this process, float32 on the
    CPU, from ``(train.seed, step, pass, rank)`` only (seed purpose ``offline.noise``): a resumed run continues
    exactly."""
    seed = stream_seed("offline.noise", ctx.train.seed, step, micro, ctx.process_index)
    gen = torch.Generator().manual_seed(seed)
    t = sample_t(gen, n, opts)  # [n]
    eps = torch.randn((n, *shape), generator=gen)  # [n, *shape]
    return t, eps


class OfflineGDROUpdate(Update):
    """``OfflineGDROUpdate(ctx, options)``: one call is one optimizer step over ``train.grad_accum`` passes
    of ``offline.batch_groups`` group ids of ``ctx.dataset`` (in the order the trainer drew them)."""

    Options = OfflineGDROOptions
    summary = "offline GDRO: Plackett-Luce over groups generated and scored once (train.mode offline)"
    digits_recipe = "digits_gdro.yaml"

    @classmethod
    def needs(cls, options) -> Needs:
        # the implicit reward compares the policy with the reference; per_reward: the ranking value's rule
        return Needs(consumes="dataset", data="groups", reference=True, reference_in_graph=True, per_reward=True,
                     unit="group")

    @property
    def ds(self):
        return self.ctx.dataset

    def batch(self, passes: list, step: int) -> Batch:
        return step_batch(passes, step)

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        return self.pass_loss(mb.rows, batch.data["step"], mb.index)

    def noise(self, step: int, micro: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared ``(t [g], eps [g, C, H, W])`` per group, from (seed, step, pass, rank) only."""
        return pass_noise(self.ctx, self.opts, step, micro, g, self.ds.latent_shape)

    def pass_loss(self, groups: torch.Tensor, step: int, micro: int) -> tuple[torch.Tensor, dict]:
        """GDRO loss of one pass over ``groups`` [G] ids -> (loss scalar, stats)."""
        ctx, reward = self.ctx, self.ctx.reward
        dev = ctx.device
        batch = self.ds.read(groups, rewards=list(reward.weights))
        per_reward = reward.aggregate == "per_reward"
        r = ranking_values(batch.rewards, reward.weights, per_reward)  # [G, k]
        finite, ranked = usable_groups(r)  # [G]
        t, eps = self.noise(step, micro, len(groups))
        with torch.no_grad():
            cond = encode_conditions(ctx.policy, batch.prompts)  # G rows
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
        shares = variance_shares(ranking_contributions(batch.rewards, reward.weights, per_reward),
                                 ranked[:, None].expand_as(r))
        stats.update({"pl_loss": pl.item(), "fm_top": reg.item(),
                      "fm_ref_top": err_ref[m].gather(1, top.view(-1, 1)).mean().item(), **ranking_stats(s[m], rr),
                      **{f"reward/{k}/adv_share": v for k, v in shares.items()}})
        return loss, stats
