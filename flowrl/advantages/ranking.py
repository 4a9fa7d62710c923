"""The value a group of samples is ranked by, under either rule of ``reward.aggregate`` (docs/algorithms.md,
"Several rewards"). Pure functions on ``[G, k]`` tables: ``G`` groups of ``k`` samples.

The ranking updates (online DPO: a group's best vs worst; online and offline GDRO: its Plackett-Luce ranking,
whose soft targets are ``softmax(value / tau)``) and Sol-RL's choice of the seeds it keeps rank by::

    sum         v = sum_k w_k r_k
    per_reward  v = sum_k w_k (r_k - mean_g r_k) / (std_g r_k + 1e-4)     (unbiased std within the group)

so under ``per_reward`` each reward counts by its rank-relevant spread within the group, whatever its scale
(MixGRPO's advantage_aggr, arXiv 2507.21802, applied to the ranking value; Flow-Factory's DPO pairs a group's
best and worst by their gdpo advantage). A group in which any weighted reward is not finite gets NaN (it carries
no ranking: the losses drop it). Each reward's contribution to the centred value (for its share,
:func:`flowrl.advantages.aggregate.variance_shares`): ``w_k (r_k - mean_g r_k)`` under ``sum``, ``w_k z_k``
under ``per_reward``.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .aggregate import weighted

RANK_EPS = 1e-4  # v = sum_k w_k (r_k - mean) / (std + 1e-4)


def standardised(r: torch.Tensor) -> torch.Tensor:
    """``(r - mean) / (std + 1e-4)`` of each row of ``r`` ``[G, k]`` (unbiased std); NaN rows stay NaN."""
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + RANK_EPS)  # [G, k]


def ranking_values(columns: Mapping[str, torch.Tensor], weights: Mapping[str, float], per_reward: bool
                   ) -> torch.Tensor:
    """The value each group's samples are ranked by ``[G, k]`` float32 (module doc) from each reward's scores
    ``columns`` (name -> ``[G, k]``) and ``weights`` (a weight 0 is left out). NaN where a weighted column is."""
    total = None
    for name in weighted(weights):
        r = columns[name].float()  # [G, k]
        if per_reward:
            r = standardised(r)
        total = weights[name] * r if total is None else total + weights[name] * r
    return total if total is not None else torch.zeros_like(next(iter(columns.values())))


def ranking_contributions(columns: Mapping[str, torch.Tensor], weights: Mapping[str, float], per_reward: bool
                          ) -> dict[str, torch.Tensor]:
    """Each weighted reward's part of the centred ranking value, name -> ``[G, k]`` (module doc)."""
    out = {}
    for name in weighted(weights):
        r = columns[name].float()  # [G, k]
        out[name] = weights[name] * (standardised(r) if per_reward else r - r.mean(dim=1, keepdim=True))
    return out
