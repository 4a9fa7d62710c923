"""Online preference updates on a rollout's finished samples: Diffusion-DPO (Wallace et al. 2023,
arXiv 2311.12908) on each prompt group's best vs worst sample (``train.loss: dpo``, Flow-GRPO's
and Flow-Factory's "online DPO"), or GDRO's Plackett-Luce loss on the whole group ranking
(arXiv 2601.02036, ``train.loss: gdro``). No log-probs are needed, so any sampler works
(``ode`` included); the reference is the adapter-disabled model.

Per group (``k`` samples of one prompt, ranked by reward): one shared ``(t, eps)``,
``x_t = (1 - t) x0_i + t eps``, implicit reward ``s_i = -beta (||v* - v_theta||^2 - ||v* - v_ref||^2)``
(per-image mean over dims). Groups whose rewards are all equal or non-finite carry no ranking and
are skipped (``zero_var_fraction``). ``t ~ U(T_MIN, 1 - T_MIN)`` and ``eps`` come from
``(train.seed, iteration, epoch)``, so resume stays exact. ``train.minibatch_size`` counts images.
"""
from __future__ import annotations

import torch

from ..losses.gdro import dpo_loss, gdro_loss, group_velocity_errors, implicit_rewards, ranking_stats, usable_groups
from ..seeding import derive_seeds
from ..types import index_cond

T_MIN = 0.02


def grouped(rollout) -> torch.Tensor:
    """``[G, k]`` sample rows of the rollout's groups (equal sizes; an error otherwise)."""
    gi = rollout.group_index
    ids = torch.unique(gi)
    rows = [torch.nonzero(gi == g).flatten() for g in ids.tolist()]
    sizes = {len(r) for r in rows}
    if len(sizes) != 1 or min(sizes) < 2:
        raise ValueError(f"preference losses need groups of equal size >= 2, got sizes {sorted(sizes)}; use the "
                         f"group, ode or sol sampler")
    return torch.stack(rows)  # [G, k]


def preference_update(trainer, rollout, it: int, pairwise: bool) -> dict:
    """One iteration of online DPO (``pairwise``) or GDRO on ``rollout``; returns averaged stats."""
    cfg = trainer.cfg.train
    rows = grouped(rollout)  # [G, k]
    r = rollout.rewards[rows].float()  # [G, k]
    usable = torch.nonzero(usable_groups(r)[1]).flatten()  # [G'] groups with a ranking
    if pairwise:  # best and worst of each group, best first
        order = torch.argsort(torch.nan_to_num(r, nan=-torch.inf), dim=1, descending=True)
        rows = torch.stack([rows.gather(1, order[:, :1]), rows.gather(1, order[:, -1:])], dim=1).squeeze(-1)  # [G, 2]
        r = rollout.rewards[rows].float()  # [G, 2]
    g_all, k = rows.shape
    dev = trainer.acc.device
    cond_all = rollout.conditioning(trainer.policy)  # the rollout's own: prompts are not encoded again
    x0_all, r_d = rollout.x0.to(dev), r.to(dev)  # once per update
    group_prompt = rollout.prompt_index[rows[:, 0]].to(dev)  # [G]
    rows_d = rows.to(dev)  # [G, k]
    per_pass = max(1, cfg.minibatch_size // k)  # groups per forward/backward pass
    sums, count = {}, 0
    trainer.model.train()
    for epoch in range(cfg.inner_epochs):
        g = torch.Generator().manual_seed(int(derive_seeds(cfg.seed * 7919 + it, epoch + 3)[-1]))
        order = usable[torch.randperm(len(usable), generator=g)].to(dev)
        t_all = (T_MIN + (1 - 2 * T_MIN) * torch.rand(g_all, generator=g)).to(dev)  # [G]
        eps_all = torch.randn((g_all, *rollout.x0.shape[1:]), generator=g).to(dev)  # [G, C, H, W], one copy
        passes = list(order.split(per_pass)) if len(order) else []

        def loss_of(mb: torch.Tensor, t_all=t_all, eps_all=eps_all) -> tuple[torch.Tensor, dict]:
            x0 = x0_all[rows_d[mb]]  # [m, k, C, H, W]
            err, err_ref = group_velocity_errors(
                trainer.policy, lambda: trainer.ref.active(trainer.policy), x0,
                index_cond(cond_all, group_prompt[mb]), t_all[mb], eps_all[mb],
                autocast=trainer.acc.autocast)  # [m, k] each
            s = implicit_rewards(err, err_ref, cfg.pref_beta)  # [m, k]
            rr = r_d[mb]  # [m, k]
            loss = dpo_loss(s[:, 0], s[:, 1]) if pairwise else gdro_loss(s, rr, cfg.pref_tau)
            return loss, {"pref_loss": loss.detach(), **ranking_stats(s.detach(), rr)}

        count += trainer._accumulate(passes, loss_of, sums)
    trainer.model.eval()
    out = {key: v / count for key, v in sums.items()} if count else {}
    out.setdefault("loss", float("nan"))
    out.update({"transitions_trained": int(len(usable)) * k * cfg.inner_epochs,
                "zero_var_fraction": 1.0 - len(usable) / max(1, g_all)})
    return out
