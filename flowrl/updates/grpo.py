"""GRPO update (``train.loss: grpo``): advantages of the rollout's structure, then the clipped-ratio
loss on its stored transitions, recomputing each transition's log-prob under the current weights
(docs/algorithms.md §2-3; Flow-GRPO arXiv 2505.05470).

Accounting: ``inner_epochs`` passes over the transitions that carry signal (zero-variance groups and
pruned edges are dropped), shuffled into minibatches of ``minibatch_size`` transitions; ``grad_accum``
consecutive minibatches make one optimizer step. A minibatch's loss is the mean over its transitions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from ..advantages import transition_advantages
from ..losses import grpo_clipped_loss, kl_form_for_step, kl_to_reference
from ..sde import get_step
from ..seeding import stream_seed
from ..errors import ConfigError
from ..types import index_cond
from .base import Update, train_epochs


# advantage-function options the update sets itself (from train.* and reward.*)
SET_BY_THE_UPDATE = {"adv_clip": "train.adv_clip_max", "global_std": "train.loss_options.global_std",
                     "per_reward_weights": "reward.aggregate: per_reward with reward.weights",
                     "iteration": "(the iteration)"}


@dataclass
class GRPOOptions:
    """``train.loss_options`` of the GRPO family (``grpo``, ``grpo_guard``)."""

    clip_range: float = 1e-3  # PPO clip epsilon on the per-step ratio (Flow-GRPO train.clip_range)
    global_std: bool = False  # normalise advantages by the whole batch's std instead of the group's
    advantage_options: dict = field(default_factory=dict)  # options of the rollout structure's advantage function

    def __post_init__(self):
        if isinstance(self.clip_range, bool) or not isinstance(self.clip_range, (int, float)) or not self.clip_range > 0:
            raise ValueError(f"train.loss_options.clip_range must be a number > 0, got {self.clip_range!r}")
        if not isinstance(self.advantage_options, dict):
            raise ValueError(f"train.loss_options.advantage_options must be a mapping, got {self.advantage_options!r}")
        for k in self.advantage_options:
            if k in SET_BY_THE_UPDATE:
                raise ValueError(f"train.loss_options.advantage_options.{k}: the update sets it; use "
                                 f"{SET_BY_THE_UPDATE[k]}")


class GRPOUpdate(Update):
    """The clipped-ratio update on stored transitions; its own knobs are :class:`GRPOOptions`, the KL
    (``train.beta_kl``, ``train.kl_form``) and the advantage clip (``train.adv_clip_max``) are shared with
    other updates and stay in ``train``. Subclasses change :meth:`surrogate`."""

    Options = GRPOOptions
    needs_transitions = True
    kl_term = True
    per_reward = True
    step_fn = None

    def __call__(self, rollout, it: int) -> tuple[dict, dict]:
        if len(rollout.transitions) == 0:
            raise ConfigError(f"the {self.ctx.sampler_name!r} sampler stored no stochastic transitions (an ODE "
                             f"sampler?), so train.loss=grpo has nothing to train; use train.loss=nft")
        adv, info = self.advantages(rollout, it)
        return self.update(rollout, adv, info, it), info

    def advantages(self, rollout, it: int) -> tuple[torch.Tensor, dict]:
        """Per-transition advantages ``[M]`` of the rollout's structure (clipped to ``+-train.adv_clip_max``
        by the structure's function), and its info."""
        ctx, cfg = self.ctx, self.ctx.train
        opts = {**self.opts.advantage_options, "global_std": self.opts.global_std, "adv_clip": cfg.adv_clip_max}
        if ctx.reward is not None and ctx.reward.aggregate == "per_reward":
            opts["per_reward_weights"] = ctx.reward.weights
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

    def update(self, rollout, adv: torch.Tensor, info: dict, it: int) -> dict:
        """The epochs of clipped-ratio minibatches over the transitions with signal -> averaged stats."""
        ctx, cfg = self.ctx, self.ctx.train
        mask = torch.ones(len(rollout.transitions), dtype=torch.bool)
        if "train_mask" in info:
            mask &= info["train_mask"].bool()
        if "zero_var" in info:
            mask &= ~info["zero_var"].bool()
        rows_all = torch.nonzero(mask).flatten()
        n_rows = ctx.min_over_processes(int(len(rows_all)))  # DDP: every rank runs as many passes
        self.step_fn = get_step(rollout.step_type)
        cond = rollout.conditioning(ctx.policy)  # the rollout's own: prompts are not encoded again
        trans = rollout.transitions.to(ctx.device)  # once per update (a no-op for what the sampler left there)
        adv_d = adv.to(ctx.device)  # [M]
        extra = self.prepare(rollout, cond, trans, rows_all)
        out, _ = train_epochs(
            ctx, rows_all, seed_of_epoch=lambda e: stream_seed("shuffle.grpo", cfg.seed, it, e),
            pass_size=cfg.minibatch_size, limit=n_rows,
            loss_of=lambda mb, _d: self.minibatch_loss(rollout, cond, mb, adv_d, trans, extra))
        out["transitions_trained"] = n_rows * cfg.inner_epochs
        return out

    def prepare(self, rollout, cond, trans, rows: torch.Tensor) -> Optional[dict]:
        """Per-update tensors the surrogate needs before any step (none here)."""
        return None

    def minibatch_loss(self, rollout, cond, rows: torch.Tensor, adv: torch.Tensor, transitions=None,
                       extra: Optional[dict] = None) -> tuple[torch.Tensor, dict]:
        """Clipped-ratio loss of transitions ``rows`` [m] (of ``transitions``, default the rollout's)
        -> (loss, stats as 0-dim tensors: no host read here)."""
        ctx, cfg = self.ctx, self.ctx.train
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
        if cfg.beta_kl > 0:
            with torch.no_grad(), ctx.reference(), ctx.autocast():
                v_ref = ctx.policy.velocity(lat, sig, c)
            ref = step_fn(v_ref, lat, sig, sig_n, noise_level=rollout.noise_level, prev_sample=nxt)
            kl = kl_to_reference(out.mean, ref.mean, out.std, dt=sig_n - sig,
                                 form=kl_form_for_step(cfg.kl_form, rollout.step_type)).mean()
            loss = loss + cfg.beta_kl * kl
            stats["kl"] = kl.detach()
        return loss, stats

    def surrogate(self, out, tr, adv: torch.Tensor, rows: torch.Tensor, extra) -> tuple[torch.Tensor, dict]:
        """The policy term of minibatch transitions ``tr`` given their step ``out`` and advantages [m]."""
        dev = self.ctx.device
        return grpo_clipped_loss(out.log_prob, tr.old_log_prob.to(dev), adv, self.opts.clip_range,
                                 tr.weight.to(dev), host_stats=False)
