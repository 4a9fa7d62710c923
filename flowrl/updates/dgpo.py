"""DGPO update (``train.loss: dgpo``; Direct Group Preference Optimization, Luo, Hu, Tang, arXiv 2510.08425,
docs/algorithms.md §12): group preference on finished (ODE) samples, each sample's implicit reward measured
by its flow-matching error against a reference (:func:`flowrl.losses.dgpo.dgpo_loss`). It reads
``Rollout.x0``, the rewards and the groups alone, so any sampler with groups of 2 or more works.

What one call trains on: every (group, training time) pair; a minibatch holds ``train.minibatch_size //
k`` of them, each a whole group of ``k`` samples at one time (``Needs.unit = "group"``): the loss sums
over every row of a group, so a group is never split. With several processes each group stays on the
process that sampled it (the sampler's prompts are per process), so a process's group sums are whole
and DDP averages the gradients as for any loss; no all-reduce of the group sums is needed. Per epoch
the trainer's generator (seed purpose ``shuffle.update``) draws ``num_times`` times shared by every
group and one noise per group (``shared_noise``, timestep-invariant, as Flow-Factory) or per sample.

The EMA old policy (kept when ``clip_dsm``, ``clip_kl`` or ``use_ema_ref``) is made on first use and
moved after every optimizer step as ``old <- d old + (1 - d) theta``, ``d = min(ema_max_decay, ema_ramp
s)`` with ``s`` the steps taken before it (the official code); it is checkpointed as
``extra["old_policy"]``. Once more than ``switch_ema_ref`` optimizer steps were taken the rollouts are
sampled with it (DGPO's ``switch_ema_ref``); ``use_ema_ref`` makes it the DGPO reference (the dynamic
reference, TDM-R1 arXiv 2603.07700), the KL always measuring against the frozen model.

The training forward is the policy's own, with its guidance (``model.guidance_scale``), as for every
flowrl update; DGPO's code trains the unguided velocity beside CFG 4.5 rollouts (docs/parity.md).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import torch

from ..losses.dgpo import DGPOOptions, dgpo_loss
from ..types import index_cond
from .base import Batch, Minibatch, Needs, Update, check_number
from .flow_matching import KeepsRampedCopy, MatchingOptions, noised, training_times
from .preference import grouped
from .rewards import sample_advantages


@dataclass
class DGPOUpdateOptions(MatchingOptions):
    """``train.loss_options`` of ``dgpo`` (defaults: Flow-Factory's ``DGPOTrainingArguments``; the published
    settings per reward are in docs/algorithms.md §12)."""

    time_range: Union[float, list] = 0.6  # Flow-Factory's port of the official "4 of the first 7 steps" at 10 steps
    beta_dpo: float = 100.0  # scale of the group preference S_g (published: 100 GenEval / OCR, 10 PickScore)
    clip_dsm: bool = True  # the one-sided DSM-ratio clip against the EMA old policy (clip_range)
    clip_kl: bool = False  # the KL rows of clipped samples carry no gradient either
    use_ema_ref: bool = False  # the DGPO reference is the EMA old policy instead of the frozen model
    switch_ema_ref: Optional[int] = None  # sample with the EMA old policy once more than this many optimizer steps
    #                                       were taken (published 200 / 500); empty: never
    shared_noise: bool = True  # one noise per group (DGPO); false: one per sample
    moved: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "beta_dpo", strict=True)
        for k in ("clip_dsm", "clip_kl", "use_ema_ref", "shared_noise"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"train.loss_options.{k} must be true or false, got {getattr(self, k)!r}")
        s = self.switch_ema_ref
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise ValueError(f"train.loss_options.switch_ema_ref must be an integer >= 0 (optimizer steps) or empty, "
                             f"got {s!r}")
        given = self.ema_options_given() + (["switch_ema_ref"] if s is not None else [])
        if given and not self.keeps_old:
            raise ValueError(f"train.loss_options.{given[0]} needs the EMA old policy, which train.loss=dgpo keeps only "
                             f"with clip_dsm, clip_kl or use_ema_ref true; set one of them, or drop {given[0]}")

    @property
    def keeps_old(self) -> bool:
        """Whether the update keeps the EMA old policy (the clips and the dynamic reference read it)."""
        return self.clip_dsm or self.clip_kl or self.use_ema_ref

    def loss_options(self, group_size: int) -> DGPOOptions:
        """The loss's settings for groups of ``group_size`` samples (:class:`flowrl.losses.dgpo.DGPOOptions`)."""
        pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
        return DGPOOptions(group_size=group_size, beta_dpo=self.beta_dpo, clip_range=pair(self.clip_range),
                           adv_clip=pair(self.adv_clip), clip_dsm=self.clip_dsm, clip_kl=self.clip_kl,
                           use_ema_ref=self.use_ema_ref, beta_kl=self.beta_kl)


class DGPOUpdate(KeepsRampedCopy, Update):
    """DGPO on a rollout's groups (module doc); keeps the EMA old policy across iterations."""

    Options = DGPOUpdateOptions
    summary = "DGPO: group preference on finished samples"
    digits_recipe = "digits_dgpo.yaml"
    COPY = "old_policy"  # the EMA old policy (self.ramped), kept with clip_dsm, clip_kl or use_ema_ref

    @classmethod
    def needs(cls, options) -> Needs:
        # the frozen model is the DGPO reference unless use_ema_ref, and the KL's; evaluated before the graph;
        # its group advantages follow reward.aggregate (flowrl.updates.rewards)
        return Needs(clean_samples=True, reference=not options.use_ema_ref or options.beta_kl > 0, per_reward=True,
                     copies=(cls.COPY,) if options.keeps_old else (), unit="group")

    def __init__(self, ctx, options=None):
        super().__init__(ctx, options)
        self.steps_seen = ctx.optimizer_steps()  # steps taken when last seen (a skipped step moves nothing)
        self.last_decay = float("nan")

    def sampling_from_old(self) -> bool:
        """Whether rollouts sample with the EMA old policy now (``switch_ema_ref`` passed)."""
        s = self.opts.switch_ema_ref
        return s is not None and self.ctx.optimizer_steps() > s

    def sampling_weights(self):
        return self.ramped_copy().applied(self.ctx.unwrapped) if self.sampling_from_old() else contextlib.nullcontext()

    def batch(self, rollout, it: int) -> Batch:
        """Every (group, time) pair (row ``g * num_times + j``), the groups' sample rows, advantages and
        conditioning; each epoch draws the times and the (per-group) noise."""
        ctx, opts = self.ctx, self.opts
        if opts.keeps_old:
            self.ramped_copy()
        groups = grouped(rollout)  # [G, k]
        adv, zero, adv_stats = sample_advantages(ctx, rollout, global_std=opts.global_std)  # [N] (reward.aggregate)
        n_groups, k = groups.shape
        t_num, dev, shape = opts.num_times, ctx.device, tuple(rollout.x0.shape[1:])
        noise_shape = (n_groups, *shape) if opts.shared_noise else (n_groups, k, *shape)

        def draws(g: torch.Generator) -> dict:  # after the epoch's permutation, from its generator
            t = training_times(opts, rollout, g).to(dev)  # [T]
            return {"t": t, "eps": torch.randn(noise_shape, generator=g).to(dev)}  # [G, (k,) C, (F,) H, W]

        data = {"cond": rollout.conditioning(ctx.policy), "x0": rollout.x0.to(dev), "adv": adv.to(dev),
                "prompt": rollout.prompt_index.to(dev), "groups": groups.to(dev), "k": k, "T": t_num,
                "loss_opts": opts.loss_options(k)}
        return Batch(torch.arange(n_groups * t_num), max(1, ctx.train.minibatch_size // k), draws=draws, data=data,
                     stats={"zero_var_fraction": zero.float().mean().item(), "dgpo/times": float(t_num),
                            "dgpo/sampling_from_old": float(self.sampling_from_old()), **adv_stats})

    def velocities(self, batch: Batch, mb: Minibatch) -> dict:
        """The tensors :func:`dgpo_loss` takes for minibatch ``mb`` (its ``m`` groups' ``m k`` rows, group by
        group), the trained velocity last (with its graph)."""
        ctx, d, o = self.ctx, batch.data, batch.data["loss_opts"]
        k = d["k"]
        g, j = mb.rows // d["T"], mb.rows % d["T"]  # [m] group, time
        rows = d["groups"][g].flatten()  # [m k]
        eps = mb.draws["eps"][g]  # [m, (k,) C, (F,) H, W]
        eps = eps.repeat_interleave(k, dim=0) if self.opts.shared_noise else eps.flatten(0, 1)  # [m k, ...]
        sigma = mb.draws["t"][j].repeat_interleave(k)  # [m k]
        x_t, target = noised(d["x0"][rows], eps, sigma)
        c = index_cond(d["cond"], d["prompt"][rows])
        out = {"v_target": target, "advantages": d["adv"][rows], "v_ref": None, "v_old": None,
               "group_index": torch.arange(len(g), device=rows.device).repeat_interleave(k)}  # [m k] dense ids
        if o.needs_old:
            with torch.no_grad(), self.ramped.applied(ctx.unwrapped), ctx.autocast():
                out["v_old"] = ctx.policy.velocity(x_t, sigma, c)
        if not o.use_ema_ref or o.beta_kl > 0:
            with torch.no_grad(), ctx.reference(), ctx.autocast():
                out["v_ref"] = ctx.policy.velocity(x_t, sigma, c)
        with ctx.autocast():
            out["v_theta"] = ctx.policy.velocity(x_t, sigma, c)  # [m k, C, (F,) H, W]
        return out

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        v = self.velocities(batch, mb)
        return dgpo_loss(v["v_theta"], v["v_target"], v["advantages"], v["group_index"], batch.data["loss_opts"],
                         v_ref=v["v_ref"], v_old=v["v_old"])

    def after_step(self, optimizer_steps: int) -> None:
        if self.ramped is not None and optimizer_steps > self.steps_seen:  # a step was taken: s steps before it
            self.last_decay = self.ramped.step(self.ctx.unwrapped, optimizer_steps - 1)
        self.steps_seen = optimizer_steps

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        out = {"transitions_trained": trained * batch.data["k"]}
        if self.ramped is not None:
            out["dgpo/old_decay"] = self.last_decay
        return out

