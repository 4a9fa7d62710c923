"""AWM update (``train.loss: awm``; Advantage Weighted Matching, Xue et al., arXiv 2509.25050,
docs/algorithms.md §11): the pretraining flow-matching loss on finished samples, weighted by their group
advantages through a clipped ratio (:func:`flowrl.losses.awm.awm_loss`). It reads ``Rollout.x0`` and the
rewards alone, so it runs with the ``ode`` sampler and with any other (``Needs.clean_samples``).

What one call trains on: every (sample, training time) pair, zero-variance groups included (their
advantage is 0, the KL terms still train them, as Flow-Factory); ``train.minibatch_size`` counts pairs.
For each epoch, :meth:`AWMUpdate.batch` draws ``num_times`` times shared by the batch and one noise per
pair (seed purpose ``update.draws``) and computes each pair's ``old_log_prob`` without gradient, before
any optimizer step of the call, under the sampling weights (:meth:`AWMUpdate.sampling_weights`: the
policy's, or the EMA copy's with ``off_policy``), as the official code does. (Flow-Factory recomputes
it before each micro-batch under the current weights; with one optimizer step per iteration, the
published setting, the two are the same.)

The EMA copy (kept when ``beta_ema_kl > 0`` or ``off_policy``) is made on first use and moved once per
iteration, after its update, as ``ema <- d ema + (1 - d) theta`` with ``d = min(ema_max_decay, ema_ramp *
iteration)`` (Flow-Factory's ``ema_step(step=epoch)``); it is checkpointed as ``extra["ema_policy"]``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses.awm import AWM_WEIGHTINGS, AWMOptions, awm_log_prob, awm_loss
from ..types import index_cond
from .base import Batch, Minibatch, Needs, Update, check_number
from .flow_matching import KeepsRampedCopy, MatchingOptions, draw_generator, noised, training_times
from .rewards import sample_advantages


@dataclass
class AWMUpdateOptions(MatchingOptions):
    """``train.loss_options`` of ``awm`` (defaults: Flow-Factory's ``AWMTrainingArguments``; the published
    recipes set ``weighting: ghuber``, ``clip_range: 1``, ``adv_clip: 1``, docs/algorithms.md §11)."""

    weighting: str = "uniform"  # the matching log-prob: uniform, t, t2, huber or ghuber (generalised Huber)
    ghuber_power: float = 0.25  # p of the ghuber weighting
    adv_scale: float = 1.0  # multiplies the clipped advantage (the official code: 1/5 with adv_clip 5)
    beta_ema_kl: float = 0.0  # weight of mean((v_theta - v_ema)^2) to the EMA copy
    off_policy: bool = False  # sample the rollouts with the EMA copy's weights
    moved: ClassVar[dict[str, str]] = {}

    def __post_init__(self):
        super().__post_init__()
        if self.weighting not in AWM_WEIGHTINGS:
            raise ValueError(f"train.loss_options.weighting must be one of {', '.join(AWM_WEIGHTINGS)}, "
                             f"got {self.weighting!r}")
        check_number(self, "ghuber_power", strict=True)
        check_number(self, "adv_scale", strict=True)
        check_number(self, "beta_ema_kl")
        if not isinstance(self.off_policy, bool):
            raise ValueError(f"train.loss_options.off_policy must be true or false, got {self.off_policy!r}")
        given = self.ema_options_given()
        if given and not self.keeps_ema:
            raise ValueError(f"train.loss_options.{given[0]} sets the EMA copy, which train.loss=awm keeps only with "
                             f"beta_ema_kl > 0 or off_policy: true; set one of them, or drop {given[0]}")

    @property
    def keeps_ema(self) -> bool:
        """Whether the update keeps an EMA copy (for the EMA KL or off-policy sampling)."""
        return self.beta_ema_kl > 0 or self.off_policy

    def loss_options(self) -> AWMOptions:
        """The loss's settings (:class:`flowrl.losses.awm.AWMOptions`)."""
        pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
        return AWMOptions(weighting=self.weighting, ghuber_power=self.ghuber_power, clip_range=pair(self.clip_range),
                          adv_clip=pair(self.adv_clip), adv_scale=self.adv_scale, beta_kl=self.beta_kl,
                          beta_ema_kl=self.beta_ema_kl)


class AWMUpdate(KeepsRampedCopy, Update):
    """AWM on finished samples (module doc); keeps the EMA copy across iterations when its options use one."""

    Options = AWMUpdateOptions
    summary = "AWM (arXiv 2509.25050): advantage-weighted flow matching on finished samples"
    digits_recipe = "digits_awm.yaml"
    COPY = "ema_policy"  # the EMA copy (self.ramped), kept with beta_ema_kl > 0 or off_policy

    @classmethod
    def needs(cls, options) -> Needs:
        # the reference and the EMA copy are evaluated before the trained forward (no graph held); its group
        # advantages follow reward.aggregate (flowrl.updates.rewards)
        return Needs(clean_samples=True, reference=options.beta_kl > 0, per_reward=True,
                     copies=(cls.COPY,) if options.keeps_ema else (), unit="sample")

    def __init__(self, ctx, options=None):
        super().__init__(ctx, options)
        self.loss_opts = self.opts.loss_options()
        self.iteration = 0

    def sampling_weights(self):
        """The EMA copy's weights with ``off_policy``, else the policy's own."""
        return self.ramped_copy().applied(self.ctx.unwrapped) if self.opts.off_policy else contextlib.nullcontext()

    # ------------------------------------------------------------ one call
    def batch(self, rollout, it: int) -> Batch:
        """Every (sample, time) pair (row ``i * num_times + j``) with each epoch's times, noise and old
        log-probs; the samples' advantages and conditioning."""
        ctx, opts = self.ctx, self.opts
        self.iteration = it
        if opts.keeps_ema:
            self.ramped_copy()
        adv, zero, adv_stats = sample_advantages(ctx, rollout, global_std=opts.global_std)  # [N] (reward.aggregate)
        n, k, dev = rollout.num_samples, opts.num_times, ctx.device
        times, eps = [], []
        for epoch in range(ctx.train.inner_epochs):  # drawn now: their old log-probs need the sampling weights
            g = draw_generator(ctx.train.seed, it, epoch)
            times.append(training_times(opts, rollout, g))  # [T]
            eps.append(torch.randn((n, k, *rollout.x0.shape[1:]), generator=g))  # [N, T, C, (F,) H, W], host
        data = {"cond": rollout.conditioning(ctx.policy), "x0": rollout.x0.to(dev), "adv": adv.to(dev),
                "prompt": rollout.prompt_index.to(dev), "t": torch.stack(times).to(dev),  # [E, T]
                "eps": torch.stack(eps), "k": k}  # [E, N, T, C, (F,) H, W] on the host, rows moved per minibatch
        rows = torch.arange(n * k)
        with torch.no_grad(), self.sampling_weights():
            data["old"] = torch.stack([self._old_log_probs(data, e, rows) for e in range(len(times))])  # [E, N T]
        return Batch(rows, ctx.train.minibatch_size, data=data,
                     stats={"zero_var_fraction": zero.float().mean().item(), "awm/times": float(k), **adv_stats})

    def _inputs(self, d: dict, epoch: int, rows: torch.Tensor):
        """``(x_t, v*, sigma, cond, sample rows)`` of pair ``rows`` [m] at ``epoch``'s draws."""
        dev = self.ctx.device
        i, j = rows // d["k"], rows % d["k"]  # [m] sample, time
        i_dev = i.to(dev)
        eps = d["eps"][epoch][i.cpu(), j.cpu()].to(dev)  # [m, C, (F,) H, W]
        sigma = d["t"][epoch][j.to(dev)]  # [m]
        x_t, target = noised(d["x0"][i_dev], eps, sigma)
        return x_t, target, sigma, index_cond(d["cond"], d["prompt"][i_dev]), i_dev

    def _old_log_probs(self, d: dict, epoch: int, rows: torch.Tensor) -> torch.Tensor:
        """:func:`awm_log_prob` of pairs ``rows`` under the weights in place (no grad), chunked -> [n] float32."""
        out = []
        for chunk in rows.split(self.ctx.train.minibatch_size):
            x_t, target, sigma, c, _ = self._inputs(d, epoch, chunk)
            with self.ctx.autocast():
                v = self.ctx.policy.velocity(x_t, sigma, c)
            out.append(awm_log_prob(v, target, sigma, self.loss_opts.weighting, self.loss_opts.ghuber_power))
        return torch.cat(out)

    def velocities(self, batch: Batch, mb: Minibatch) -> dict:
        """The tensors :func:`awm_loss` takes for minibatch ``mb``, the trained velocity last (with its graph)."""
        ctx, d, o = self.ctx, batch.data, self.loss_opts
        x_t, target, sigma, c, i = self._inputs(d, mb.epoch, mb.rows)
        out = {"v_target": target, "sigma": sigma, "old_log_prob": d["old"][mb.epoch][mb.rows.to(ctx.device)],
               "advantages": d["adv"][i], "v_ref": None, "v_ema": None}
        if o.beta_kl > 0:
            with torch.no_grad(), ctx.reference(), ctx.autocast():
                out["v_ref"] = ctx.policy.velocity(x_t, sigma, c)
        if o.beta_ema_kl > 0:
            with torch.no_grad(), self.ramped.applied(ctx.unwrapped), ctx.autocast():
                out["v_ema"] = ctx.policy.velocity(x_t, sigma, c)
        with ctx.autocast():
            out["v_theta"] = ctx.policy.velocity(x_t, sigma, c)  # [m, C, (F,) H, W]
        return out

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        v = self.velocities(batch, mb)
        return awm_loss(v["v_theta"], v["v_target"], v["sigma"], v["old_log_prob"], v["advantages"], self.loss_opts,
                        v_ref=v["v_ref"], v_ema=v["v_ema"])

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        out = {"transitions_trained": trained}
        if self.ramped is not None:  # once per iteration, after its update
            out["awm/ema_decay"] = self.ramped.step(self.ctx.unwrapped, self.iteration)
        return out
