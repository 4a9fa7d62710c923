"""GRPO update (``train.loss: grpo``): advantages of the rollout's structure, then the clipped-ratio
loss on its stored transitions, recomputing each transition's log-prob under the current weights
(docs/algorithms.md §2-3; Flow-GRPO arXiv 2505.05470).

What it trains on: the transitions that carry signal (zero-variance groups and pruned edges are dropped),
``train.minibatch_size`` per minibatch, shuffled per epoch (seed purpose ``shuffle.grpo``); the trainer
runs the epochs and steps. A minibatch's loss is the mean over its transitions.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar, Optional

import torch

from ..advantages import transition_advantages
from ..errors import ConfigError
from ..losses import KL_FORMS, grpo_clipped_loss, kl_form_for_step, kl_to_reference
from ..sde import get_step
from ..types import index_cond
from .base import Batch, Minibatch, Needs, Update, UpdateOptions, check_number
from .rewards import rule, share_stats


# advantage-function options the update sets itself (from its own options and reward.*)
SET_BY_THE_UPDATE = {"adv_clip": "train.loss_options.adv_clip_max", "global_std": "train.loss_options.global_std",
                     "per_reward_weights": "reward.aggregate: per_reward with reward.weights",
                     "reward_weights": "reward.weights",
                     "iteration": "(the iteration)"}


@dataclass
class TransitionOptions(UpdateOptions):
    """``train.loss_options`` every update on stored transitions takes (advantages, the KL to the reference)."""

    global_std: bool = False  # normalise advantages by the whole batch's std instead of the group's
    advantage_options: dict = field(default_factory=dict)  # options of the rollout structure's advantage function
    adv_clip_max: float = 5.0  # advantages are clipped to +-this (Flow-GRPO train.adv_clip_max)
    beta_kl: float = 0.0  # weight of the KL to the reference (adapter-disabled) policy; 0: no reference kept
    kl_form: str = "flow_grpo"  # 'flow_grpo' (Flow-GRPO's code: squared mean gap over 2 std_t^2, published betas
    #                             carry over) or 'exact' (the KL of the two transition Gaussians); docs/algorithms.md
    moved: ClassVar[dict[str, str]] = {f"train.{k}": k for k in ("global_std", "advantage_options",
                                                                  "adv_clip_max", "beta_kl", "kl_form")}

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "adv_clip_max", strict=True)
        check_number(self, "beta_kl")
        if self.kl_form not in KL_FORMS:
            raise ValueError(f"train.loss_options.kl_form must be one of {', '.join(KL_FORMS)}, got {self.kl_form!r}")
        if not isinstance(self.advantage_options, dict):
            raise ValueError(f"train.loss_options.advantage_options must be a mapping, got {self.advantage_options!r}")
        for k in self.advantage_options:
            if k in SET_BY_THE_UPDATE:
                raise ValueError(f"train.loss_options.advantage_options.{k}: the update sets it; use "
                                 f"{SET_BY_THE_UPDATE[k]}")


@dataclass
class GRPOOptions(TransitionOptions):
    """``train.loss_options`` of the clipped-ratio family (``grpo``, ``grpo_guard``)."""

    clip_range: float = 1e-3  # PPO clip epsilon on the per-step ratio (Flow-GRPO train.clip_range)
    moved: ClassVar[dict[str, str]] = {"train.clip_range": "clip_range"}

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "clip_range", strict=True)


class GRPOUpdate(Update):
    """The clipped-ratio update on stored transitions (its knobs: :class:`GRPOOptions`). Subclasses change
    :meth:`surrogate` and may compute per-call tensors before any step in :meth:`prepare`."""

    Options = GRPOOptions
    summary = "Flow-GRPO (arXiv 2505.05470): clipped probability ratio on stored SDE transitions"
    step_fn = None

    @classmethod
    def needs(cls, options) -> Needs:
        kl = options.beta_kl > 0
        return Needs(transitions=True, reference=kl, reference_in_graph=kl, per_reward=True, unit="transition")

    def batch(self, rollout, it: int) -> Batch:
        """The transitions that carry signal (zero-variance groups and pruned edges dropped), with their
        advantages, the rollout's conditioning and :meth:`prepare`'s tensors."""
        if len(rollout.transitions) == 0:
            raise ConfigError(f"the {self.ctx.sampler_name!r} sampler stored no stochastic transitions (an ODE "
                             f"sampler?), so train.loss=grpo has nothing to train; use train.loss=nft")
        ctx = self.ctx
        adv, info = self.advantages(rollout, it)
        mask = torch.ones(len(rollout.transitions), dtype=torch.bool)
        if "train_mask" in info:
            mask &= info["train_mask"].bool()
        if "zero_var" in info:
            mask &= ~info["zero_var"].bool()
        info.update(share_stats(ctx, info.pop("contributions", {}), mask))  # each reward's share of what trains
        rows = torch.nonzero(mask).flatten()
        self.step_fn = get_step(rollout.step_type)
        cond = rollout.conditioning(ctx.policy)  # the rollout's own: prompts are not encoded again
        trans = rollout.transitions.to(ctx.device)  # once per update (a no-op for what the sampler left there)
        extra = self.prepare(rollout, cond, trans, rows)
        data = {"rollout": rollout, "cond": cond, "transitions": trans, "adv": adv.to(ctx.device), "extra": extra}
        return Batch(rows, ctx.train.minibatch_size, shuffle="shuffle.grpo", data=data, info=info)

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        d = batch.data
        return self.minibatch_loss(d["rollout"], d["cond"], mb.rows, d["adv"], d["transitions"], d["extra"])

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        return {"transitions_trained": trained}

    def advantages(self, rollout, it: int) -> tuple[torch.Tensor, dict]:
        """Per-transition advantages ``[M]`` of the rollout's structure under ``reward.aggregate`` (clipped to
        ``+-adv_clip_max`` by the structure's function), and its info (``contributions``: each reward's part)."""
        ctx = self.ctx
        opts = {**self.opts.advantage_options, "global_std": self.opts.global_std, "adv_clip": self.opts.adv_clip_max}
        per_reward, weights = rule(ctx)
        opts["reward_weights"] = weights  # each reward's contribution (its share of the advantages)
        if per_reward:
            opts["per_reward_weights"] = weights
        view = rollout
        if ctx.num_processes > 1 and rollout.structure == "group":
            # groups stay on their rank; statistics (global std, logging) see every rank's samples
            n, p, rank = rollout.num_samples, len(rollout.prompts), ctx.process_index
            view = SimpleNamespace(
                structure="group", rewards=ctx.gather(rollout.rewards),
                group_index=ctx.gather(rollout.group_index + rank * p),
                reward_components={k: ctx.gather(v) for k, v in rollout.reward_components.items()},
                transitions=SimpleNamespace(sample_index=rollout.transitions.sample_index + rank * n))
        return transition_advantages(view, iteration=it, **opts)

    def prepare(self, rollout, cond, trans, rows: torch.Tensor) -> Optional[dict]:
        """Per-call tensors the surrogate needs, computed before any step (none here)."""
        return None

    def step_means(self, rollout, cond, trans, rows: torch.Tensor, weights=None) -> torch.Tensor:
        """Step means ``[M, C, H, W]`` of transitions ``rows`` under the current weights (or inside the context
        ``weights()``, e.g. a copy's), no grad, in minibatches; rows without signal stay 0 (never read). Called
        from :meth:`prepare`, before any optimizer step: the sampling-time means of GRPO-Guard and Flow-DPPO."""
        ctx = self.ctx
        out = torch.zeros_like(trans.next_latents)  # [M, C, H, W]
        if not len(rows):  # every group without signal (split would give one empty minibatch)
            return out
        with torch.no_grad(), (weights() if weights is not None else contextlib.nullcontext()):
            for mb in rows.to(ctx.device).split(ctx.train.minibatch_size):
                tr = trans.select(mb)
                with ctx.autocast():
                    v = ctx.policy.velocity(tr.latents, tr.sigma, index_cond(cond, tr.prompt_index))
                out[mb] = self.step_fn(v, tr.latents, tr.sigma, tr.sigma_next, noise_level=rollout.noise_level,
                                       prev_sample=tr.next_latents).mean
        return out

    def minibatch_loss(self, rollout, cond, rows: torch.Tensor, adv: torch.Tensor, transitions=None,
                       extra: Optional[dict] = None) -> tuple[torch.Tensor, dict]:
        """Clipped-ratio loss of transitions ``rows`` [m] (of ``transitions``, default the rollout's)
        -> (loss, stats as 0-dim tensors: no host read here)."""
        ctx, opts = self.ctx, self.opts
        step_fn = self.step_fn or get_step(rollout.step_type)
        tr = (rollout.transitions if transitions is None else transitions).select(rows)
        dev = ctx.device
        c = index_cond(cond, tr.prompt_index)
        lat, nxt = tr.latents.to(dev), tr.next_latents.to(dev)  # [m, C, H, W]
        sig, sig_n = tr.sigma.to(dev), tr.sigma_next.to(dev)  # [m]
        with ctx.autocast():
            v = ctx.policy.velocity(lat, sig, c)  # [m, C, H, W]
        out = step_fn(v, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
        loss, stats = self.surrogate(out, tr, adv[rows.to(adv.device)].to(dev), rows, extra)
        stats["policy_loss"] = loss.detach()
        if opts.beta_kl > 0:
            ref_mean = self.reference_mean(rollout, step_fn, tr, c, rows, extra)
            kl = self.kl_penalty(kl_to_reference(out.mean, ref_mean, out.std, dt=sig_n - sig,
                                                 form=kl_form_for_step(opts.kl_form, rollout.step_type)), rows)
            loss = loss + opts.beta_kl * kl
            stats["kl"] = kl.detach()
        return loss, stats

    def reference_mean(self, rollout, step_fn, tr, c, rows: torch.Tensor, extra) -> torch.Tensor:
        """The reference's step means ``[m, C, H, W]`` of minibatch transitions ``tr`` (no grad): here the frozen
        reference evaluated now; an update with its own reference may read them from :meth:`prepare`'s tensors."""
        dev = self.ctx.device
        lat, sig, sig_n = tr.latents.to(dev), tr.sigma.to(dev), tr.sigma_next.to(dev)
        with torch.no_grad(), self.ctx.reference(), self.ctx.autocast():
            v_ref = self.ctx.policy.velocity(lat, sig, c)
        return step_fn(v_ref, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=tr.next_latents.to(dev)).mean

    def kl_penalty(self, kl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The KL term of the minibatch from its per-transition KL ``[m]`` (of transitions ``rows``): the mean."""
        return kl.mean()

    def surrogate(self, out, tr, adv: torch.Tensor, rows: torch.Tensor, extra) -> tuple[torch.Tensor, dict]:
        """The policy term of minibatch transitions ``tr`` given their step ``out`` and advantages [m]."""
        dev = self.ctx.device
        return grpo_clipped_loss(out.log_prob, tr.old_log_prob.to(dev), adv, self.opts.clip_range,
                                 tr.weight.to(dev), host_stats=False)
