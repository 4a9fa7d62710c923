"""Online preference updates on a rollout's finished samples: Diffusion-DPO (Wallace et al. 2023,
arXiv 2311.12908) on each prompt group's best vs worst sample (``train.loss: dpo``, Flow-GRPO's
and Flow-Factory's "online DPO"), or GDRO's Plackett-Luce loss on the whole group ranking
(arXiv 2601.02036, ``train.loss: gdro``). No log-probs are needed, so any sampler works
(``ode`` included); the reference is the adapter-disabled model.

Per group (``k`` samples of one prompt, ranked by reward): one shared ``(t, eps)``,
``x_t = (1 - t) x0_i + t eps``, implicit reward ``s_i = -beta (||v* - v_theta||^2 - ||v* - v_ref||^2)``
(per-image mean over dims). Groups are ranked by the weighted sum of the rewards, or with ``reward.aggregate:
per_reward`` by the weighted sum of each reward standardised within the group
(:mod:`flowrl.advantages.ranking`); groups whose values are all equal or non-finite carry no ranking and
are skipped (``zero_var_fraction``). ``t ~ U(T_MIN, 1 - T_MIN)`` and ``eps`` come from
``(train.seed, iteration, epoch)`` (seed purpose ``shuffle.preference``), so resume stays exact.
``train.minibatch_size`` counts images: a minibatch holds ``minibatch_size // k`` whole groups (pairs for DPO).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses.gdro import dpo_loss, gdro_loss, group_velocity_errors, implicit_rewards, ranking_stats, usable_groups
from ..types import index_cond
from .base import Batch, Minibatch, Needs, Update, UpdateOptions
from .rewards import group_ranking, share_stats

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


@dataclass
class PreferenceOptions(UpdateOptions):
    beta: float = 12.0  # implicit-reward beta of -beta (err - err_ref), per-image mean squared velocity errors
    #                     (GDRO: 12 for OCR, 6 for GenEval)
    tau: float = 0.05   # gdro: Plackett-Luce target temperature over rewards, 0 = hard (dpo: unused)
    moved: ClassVar[dict[str, str]] = {"train.pref_beta": "beta", "train.pref_tau": "tau"}

    def __post_init__(self):
        super().__post_init__()
        if not self.beta > 0 or not self.tau >= 0:
            raise ValueError(f"train.loss_options: beta must be > 0 and tau >= 0, got {self.beta}, {self.tau}")


class GDROUpdate(Update):
    """Online GDRO: the Plackett-Luce loss over each group's whole ranking."""

    Options = PreferenceOptions
    summary = "online GDRO: Plackett-Luce over each group's ranking of finished samples"
    pairwise = False

    @classmethod
    def needs(cls, options) -> Needs:
        # the implicit reward compares the policy with the reference, beside the training graph; groups are ranked
        # by reward.aggregate's ranking value (flowrl.updates.rewards.group_ranking)
        return Needs(clean_samples=True, reference=True, reference_in_graph=True, per_reward=True,
                     unit="pair" if cls.pairwise else "group")

    def batch(self, rollout, it: int) -> Batch:
        """The groups with a ranking (``[G, k]`` sample rows, best and worst only for DPO), their ranking values
        under ``reward.aggregate`` (:func:`flowrl.updates.rewards.group_ranking`) and conditioning; each epoch
        draws one ``(t, eps)`` per group."""
        ctx = self.ctx
        rows = grouped(rollout)  # [G, k]
        r, contrib = group_ranking(ctx, rollout, rows)  # [G, k], name -> [G, k]
        ranked = usable_groups(r)[1]  # [G] groups with a ranking
        usable = torch.nonzero(ranked).flatten()  # [G']
        shares = share_stats(ctx, contrib, ranked[:, None].expand_as(r))
        if self.pairwise:  # best and worst of each group, best first
            order = torch.argsort(torch.nan_to_num(r, nan=-torch.inf), dim=1, descending=True)  # [G, k]
            pick = torch.cat([order[:, :1], order[:, -1:]], dim=1)  # [G, 2]
            rows, r = rows.gather(1, pick), r.gather(1, pick)  # [G, 2] each
        g_all, k = rows.shape
        dev = ctx.device

        def draws(g: torch.Generator) -> dict:
            t_all = (T_MIN + (1 - 2 * T_MIN) * torch.rand(g_all, generator=g)).to(dev)  # [G]
            return {"t": t_all, "eps": torch.randn((g_all, *rollout.x0.shape[1:]), generator=g).to(dev)}  # [G, C, H, W]

        data = {"cond": rollout.conditioning(ctx.policy),  # the rollout's own: prompts are not encoded again
                "x0": rollout.x0.to(dev), "r": r.to(dev), "prompt": rollout.prompt_index[rows[:, 0]].to(dev),  # [G]
                "rows": rows.to(dev), "k": k}  # [G, k]
        return Batch(usable, max(1, ctx.train.minibatch_size // k), shuffle="shuffle.preference", draws=draws,
                     data=data, stats={"loss": float("nan"), "zero_var_fraction": 1.0 - len(usable) / max(1, g_all),
                                       **shares})

    def loss(self, batch: Batch, mb: Minibatch) -> tuple[torch.Tensor, dict]:
        d = batch.data
        err, err_ref = group_velocity_errors(
            self.ctx.policy, self.ctx.reference, d["x0"][d["rows"][mb.rows]], index_cond(d["cond"], d["prompt"][mb.rows]),
            mb.draws["t"][mb.rows], mb.draws["eps"][mb.rows], autocast=self.ctx.autocast)  # [m, k] each
        s = implicit_rewards(err, err_ref, self.opts.beta)  # [m, k]
        rr = d["r"][mb.rows]  # [m, k]
        loss = dpo_loss(s[:, 0], s[:, 1]) if self.pairwise else gdro_loss(s, rr, self.opts.tau)
        return loss, {"pref_loss": loss.detach(), **ranking_stats(s.detach(), rr)}

    def after_update(self, batch: Batch, trained: int, optimizer_steps: int) -> dict:
        return {"transitions_trained": trained * batch.data["k"]}


class DPOUpdate(GDROUpdate):
    """Online Diffusion-DPO: each group's best vs worst sample (``tau`` unused)."""

    summary = "online Diffusion-DPO: each group's best vs worst finished sample"

    pairwise = True
