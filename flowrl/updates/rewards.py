"""What the updates read of the rewards (docs/algorithms.md, "Several rewards"): the rule of ``reward.aggregate``
with ``reward.weights``, the group advantages of a rollout's finished samples under it, the ranking value of its
groups, and each reward's share of what trains (``reward/<name>/adv_share``, summed over processes).

Every update that turns rewards into advantages or rankings reads them here, or, on stored transitions, through
its rollout structure's advantage function given the same rule (:mod:`flowrl.advantages.aggregate`); so each
declares ``Needs(per_reward=True)``. The math is in :mod:`flowrl.advantages`; this module turns an
:class:`~flowrl.updates.base.UpdateContext` and a rollout into its arguments.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..advantages.aggregate import aggregate, check_components, share_sums, shares_from_sums, weighted
from ..advantages.group import group_normalised
from ..advantages.ranking import ranking_contributions, ranking_values


def rule(ctx) -> tuple[bool, Optional[dict]]:
    """``(per_reward, weights)``: whether ``reward.aggregate`` is ``per_reward``, and ``reward.weights`` (None
    without a reward config: the rollout's weighted sum alone, no shares)."""
    reward = getattr(ctx, "reward", None)
    if reward is None:
        return False, None
    return reward.aggregate == "per_reward", dict(reward.weights)


def share_stats(ctx, contributions: Mapping[str, torch.Tensor], mask: Optional[torch.Tensor] = None) -> dict:
    """``{"reward/<name>/adv_share": share}`` of each reward's ``contributions`` (name -> ``[n]``, this process's
    rows) over the rows of ``mask`` (``[n]`` bool: those that train), summed over every process
    (:func:`flowrl.advantages.aggregate.variance_shares`); empty without contributions."""
    if not contributions:
        return {}
    sums = share_sums(contributions, mask)  # [K + 1]
    if getattr(ctx, "num_processes", 1) > 1:
        sums = ctx.gather(sums).double().cpu().view(ctx.num_processes, -1).sum(dim=0)  # [K + 1] every process's
    return {f"reward/{k}/adv_share": v for k, v in shares_from_sums(list(contributions), sums).items()}


def aggregated_advantages(ctx, rollout, *, global_std: bool = False, clip: Optional[float] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Group advantages of the rollout's finished samples under ``reward.aggregate`` -> ``(A [N], zero_var [N]
    bool, contributions)`` (Flow-GRPO's normalisation, population std + 1e-4:
    :func:`flowrl.advantages.group_advantages`, clipped to ``+-clip``; None: not clipped, for a loss that clips;
    ``contributions``: each reward's part of ``A``, name -> ``[N]``). No collective unless ``global_std``.

    Groups stay on their process; with ``global_std`` and several processes the std is that of every process's
    rewards (gathered)."""
    per_reward, weights = rule(ctx)
    r, groups, comps = rollout.rewards.float(), rollout.group_index, dict(rollout.reward_components)
    n, rank = rollout.num_samples, ctx.process_index
    gathered = global_std and ctx.num_processes > 1
    if gathered:  # [W N] each, replica order; group ids distinct per process (< n each)
        r, groups = ctx.gather(r), ctx.gather(groups + rank * n)
        comps = {k: ctx.gather(v.float()) for k, v in comps.items()}
    agg = aggregate(lambda x: group_normalised(x, groups, global_std=global_std), r, comps, weights, per_reward, clip)
    adv, zero, contrib = agg.advantages, agg.zero, agg.contributions
    if gathered:
        mine = slice(rank * n, (rank + 1) * n)
        adv, zero, contrib = adv[mine], zero[mine], {k: v[mine] for k, v in contrib.items()}
    return adv, zero, contrib


def sample_advantages(ctx, rollout, *, global_std: bool = False, clip: Optional[float] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """:func:`aggregated_advantages` with each reward's share of the samples that train as ``stats``
    (:func:`share_stats`: collective) -> ``(A [N], zero_var [N] bool, stats)``."""
    adv, zero, contrib = aggregated_advantages(ctx, rollout, global_std=global_std, clip=clip)
    return adv, zero, share_stats(ctx, contrib, ~zero)


def group_ranking(ctx, rollout, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The ranking value of the rollout's groups ``rows`` (``[G, k]`` sample rows) under ``reward.aggregate``
    (:func:`flowrl.advantages.ranking.ranking_values`: the weighted sum, ``rollout.rewards``, under ``sum``) and each
    weighted reward's contribution (name -> ``[G, k]``; empty when the rollout holds no scores of one)."""
    per_reward, weights = rule(ctx)
    cols = {k: v[rows] for k, v in rollout.reward_components.items()}  # name -> [G, k]
    if per_reward:
        check_components(cols, weights)
        values = ranking_values(cols, weights, per_reward=True)  # [G, k]
    else:
        values = rollout.rewards[rows].float()  # [G, k]
    known = bool(weights) and all(k in cols for k in weighted(weights))
    return values, ranking_contributions(cols, weights, per_reward) if known else {}
