"""DiffusionNFT update (arXiv 2509.16117; Sol-RL's trainer, docs/algorithms.md §7): trains on finished
samples alone (``Rollout.x0`` and rewards), no log-probs, so any sampler works, ODE included.

The old (sampling) policy is a second copy of the trained tensors (LoRA: a few MB), updated after
every optimizer step as ``old <- d old + (1 - d) theta`` with ``d = min(0.001 * step, 0.5)``.
Each sample is trained at one ``t ~ U(t_min, 1)`` with fresh noise per epoch, both derived from
``(seed, iteration, epoch)`` so resume stays exact.
"""
from __future__ import annotations

import torch

from ..advantages import group_advantages
from ..losses import nft_loss
from ..seeding import derive_seeds
from ..types import index_cond
from .weights import EMA

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


def nft_update(trainer, rollout, it: int) -> dict:
    """One iteration of DiffusionNFT on ``rollout``'s samples; returns averaged stats."""
    cfg = trainer.cfg.train
    if trainer.old_policy is None:
        trainer.old_policy = OldPolicy(trainer.unwrapped)
    adv, zero = group_advantages(rollout.rewards, rollout.group_index, global_std=cfg.global_std,
                                 clip=cfg.adv_clip_max)
    rows_all = torch.nonzero(~zero).flatten()
    dev = trainer.acc.device
    cond_all = rollout.conditioning(trainer.policy)  # the rollout's own: prompts are not encoded again
    x0_all, adv_d, prompt_d = rollout.x0.to(dev), adv.to(dev), rollout.prompt_index.to(dev)  # once per update
    sums, count = {}, 0
    trainer.model.train()
    for epoch in range(cfg.inner_epochs):
        seed = derive_seeds(cfg.seed * 7919 + it, epoch + 2)[-1]
        g = torch.Generator().manual_seed(int(seed))
        rows = rows_all[torch.randperm(len(rows_all), generator=g)].to(dev)
        t_all = (T_MIN + (1 - T_MIN) * torch.rand(rollout.num_samples, generator=g)).to(dev)  # [N]
        eps_all = torch.randn(rollout.x0.shape, generator=g).to(dev)  # [N, C, H, W], one copy per epoch
        mbs = list(rows.split(cfg.minibatch_size)) if len(rows) else []

        def loss_of(mb: torch.Tensor, t_all=t_all, eps_all=eps_all) -> tuple[torch.Tensor, dict]:
            x0 = x0_all[mb]  # [m, C, H, W]
            t = t_all[mb]  # [m]
            x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps_all[mb]
            c = index_cond(cond_all, prompt_d[mb])
            with torch.no_grad(), trainer.old_policy.applied(trainer.unwrapped):
                v_old = trainer.policy.velocity(x_t, t, c)
            v_ref = None
            if cfg.beta_kl > 0:
                with torch.no_grad(), trainer.ref.active(trainer.policy):
                    v_ref = trainer.policy.velocity(x_t, t, c)
            with trainer.acc.autocast():
                v = trainer.policy.velocity(x_t, t, c)
            return nft_loss(v, v_old, x_t, x0, t, adv_d[mb], beta=cfg.nft_beta,
                            adv_clip_max=cfg.adv_clip_max, v_ref=v_ref, beta_kl=cfg.beta_kl)

        count += trainer._accumulate(mbs, loss_of, sums,
                                     after_step=lambda: trainer.old_policy.step(trainer.unwrapped, trainer.opt_steps))
    trainer.model.eval()
    out = {k: v / count for k, v in sums.items()} if count else {}
    out.update({"transitions_trained": int(len(rows_all)) * cfg.inner_epochs, "zero_var_fraction": zero.float().mean().item(),
                "nft/old_decay": OldPolicy.decay_at(trainer.opt_steps)})
    return out
