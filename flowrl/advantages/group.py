"""Group advantages (Flow-GRPO / DanceGRPO / MixGRPO; docs/algorithms.md, GRPO). Pure functions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .aggregate import Normalised, aggregate

ADV_CLIP = 5.0
GROUP_EPS = 1e-4  # Flow-GRPO: A = (r - mean) / (std + 1e-4)


@dataclass(frozen=True)
class Normalisation:
    """How a group's rewards become advantages: ``(r - mean) / (std + eps)``."""

    unbiased: bool  # std with Bessel's correction (n - 1) or the population std (n)
    eps: float


# named group normalisations of the peers' code (train.loss_options.advantage_options.normalisation)
NORMALISATIONS = {
    "flow_grpo": Normalisation(unbiased=False, eps=GROUP_EPS),  # Flow-GRPO (numpy std) + 1e-4
    "dance_grpo": Normalisation(unbiased=True, eps=1e-8),       # DanceGRPO (torch std) + 1e-8
}


def get_normalisation(name: str) -> Normalisation:
    try:
        return NORMALISATIONS[name]
    except KeyError:
        raise ValueError(f"unknown advantage normalisation {name!r}; choose one of {sorted(NORMALISATIONS)}") from None


def group_normalised(rewards: torch.Tensor, groups: torch.Tensor, *, global_std: bool = False,
                     eps: float = GROUP_EPS, unbiased: bool = False) -> Normalised:
    """Per-group normalisation of ``rewards`` [N] (:func:`group_advantages`' math, before its clip):
    ``centred = r - mean_g(r)``, ``scale = std + eps`` (the group's std, or with ``global_std`` the batch's),
    centred 0 and scale 1 for non-finite rewards and groups without signal, ``zero`` marking those groups."""
    r = rewards.float()
    valid = torch.isfinite(r)
    centred, scale = torch.zeros_like(r), torch.ones_like(r)  # [N], [N]
    zero = torch.zeros_like(r, dtype=torch.bool)
    gstd = r[valid].std(unbiased=unbiased) if global_std and valid.sum() > 1 else None
    for gid in torch.unique(groups):
        m = (groups == gid) & valid
        if m.sum() == 0:
            zero |= groups == gid
            continue
        rg = r[m]
        if rg.numel() < 2 or (rg.max() - rg.min()).abs() <= 1e-12 * max(1.0, rg.abs().max().item()):
            zero |= groups == gid
            continue
        std = gstd if gstd is not None else rg.std(unbiased=unbiased)
        centred[m], scale[m] = rg - rg.mean(), std + eps
    return Normalised(centred, scale, zero)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, global_std: bool = False,
                     eps: float = GROUP_EPS, clip: Optional[float] = ADV_CLIP,
                     unbiased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group normalised rewards (Flow-GRPO arXiv 2505.05470 / DanceGRPO arXiv 2505.07818).

    ``A = (r - mean_g(r)) / (std + eps)``, clipped to ``+-clip`` (None: not clipped, for a caller
    whose loss clips, as DiffusionNFT's does).

    Args:
        rewards: ``[N]`` float32, already gathered over all processes.
        groups: ``[N]`` long group id (prompt, or prompt x seed).
        global_std: divide by the std of the whole batch instead of the group's.
        unbiased: Bessel-corrected std (DanceGRPO's torch ``std()``); default the population
            std (``unbiased=False``, numpy's, as in Flow-GRPO).
    Returns:
        ``(A [N] float32 clipped to +-clip, zero_var [N] bool)``: ``zero_var`` marks samples
        whose group rewards are all equal (A = 0, no signal; the trainer skips them). NaN
        rewards are ignored in the statistics and get A = 0.
    """
    n = group_normalised(rewards, groups, global_std=global_std, eps=eps, unbiased=unbiased)
    return n.advantages(clip), n.zero


def combine_component_advantages(components: dict[str, torch.Tensor], weights: dict[str, float],
                                 groups: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """MixGRPO ``advantage_aggr``: normalise each reward of non-zero weight within its groups (each clipped to
    ``+-clip``), then weight and sum; the sum is clipped to ``+-clip`` again (weights may add up past 1), so the
    result is within the clip like :func:`group_advantages`' (``kw`` as there; :func:`flowrl.advantages.aggregate`).

    A sample is zero-variance only if it is so for every reward of non-zero weight.
    """
    clip = kw.pop("clip", ADV_CLIP)
    agg = aggregate(lambda r: group_normalised(r, groups, **kw), torch.zeros(len(groups)), components, weights,
                    per_reward=True, clip=clip)
    return agg.advantages, agg.zero


def group_structure(rollout, *, global_std: bool = False, per_reward_weights: Optional[dict] = None,
                    reward_weights: Optional[dict] = None, normalisation: str = "flow_grpo",
                    adv_clip: float = ADV_CLIP, **_: object) -> tuple[torch.Tensor, dict]:
    """Advantages of a flat group rollout: each transition takes its sample's group advantage,
    clipped to ``+-adv_clip`` (``train.loss_options.adv_clip_max``; the update uses them as they are).

    ``normalisation`` names the std and eps (:data:`NORMALISATIONS`: ``flow_grpo`` or
    ``dance_grpo``). ``per_reward_weights``: each reward normalised apart, then weighted (``reward.aggregate:
    per_reward``); else the weighted sum ``rollout.rewards`` is normalised, and ``reward_weights`` (when given)
    splits it into each reward's contribution. ``info["contributions"]``: name -> ``[M]`` (:mod:`.aggregate`).
    """
    norm = get_normalisation(normalisation)
    kw = dict(global_std=global_std, eps=norm.eps, unbiased=norm.unbiased)
    agg = aggregate(lambda r: group_normalised(r, rollout.group_index, **kw), rollout.rewards,
                    getattr(rollout, "reward_components", {}), per_reward_weights or reward_weights,
                    bool(per_reward_weights), adv_clip)
    idx = rollout.transitions.sample_index
    return agg.advantages[idx], {"zero_var": agg.zero[idx], "zero_var_fraction": agg.zero.float().mean().item(),
                                 "contributions": {k: v[idx] for k, v in agg.contributions.items()}}
