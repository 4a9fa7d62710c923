"""Group advantages (Flow-GRPO / DanceGRPO / MixGRPO; docs/algorithms.md, GRPO). Pure functions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

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
    r = rewards.float()
    valid = torch.isfinite(r)
    adv = torch.zeros_like(r)
    zero_var = torch.zeros_like(r, dtype=torch.bool)
    gstd = r[valid].std(unbiased=unbiased) if global_std and valid.sum() > 1 else None
    for gid in torch.unique(groups):
        m = (groups == gid) & valid
        if m.sum() == 0:
            zero_var |= groups == gid
            continue
        rg = r[m]
        if rg.numel() < 2 or (rg.max() - rg.min()).abs() <= 1e-12 * max(1.0, rg.abs().max().item()):
            zero_var |= groups == gid
            continue
        std = gstd if gstd is not None else rg.std(unbiased=unbiased)
        adv[m] = (rg - rg.mean()) / (std + eps)
    return (adv if clip is None else adv.clamp(-clip, clip)), zero_var


def combine_component_advantages(components: dict[str, torch.Tensor], weights: dict[str, float],
                                 groups: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """MixGRPO ``advantage_aggr``: normalise each reward within its groups (each clipped to ``+-clip``),
    then weight and sum; the sum is clipped to ``+-clip`` again (weights may add up past 1), so the
    result is within the clip like :func:`group_advantages`' ``kw`` as there.

    A sample is zero-variance only if it is so for every component.
    """
    total, zero = None, None
    for name, r in components.items():
        a, z = group_advantages(r, groups, **kw)
        total = weights[name] * a if total is None else total + weights[name] * a
        zero = z if zero is None else zero & z
    clip = kw.get("clip", ADV_CLIP)
    return (total if clip is None else total.clamp(-clip, clip)), zero


def group_structure(rollout, *, global_std: bool = False, per_reward_weights: Optional[dict] = None,
                    normalisation: str = "flow_grpo", adv_clip: float = ADV_CLIP,
                    **_: object) -> tuple[torch.Tensor, dict]:
    """Advantages of a flat group rollout: each transition takes its sample's group advantage,
    clipped to ``+-adv_clip`` (``train.loss_options.adv_clip_max``; the update uses them as they are).

    ``normalisation`` names the std and eps (:data:`NORMALISATIONS`: ``flow_grpo`` or
    ``dance_grpo``).
    """
    norm = get_normalisation(normalisation)
    kw = dict(global_std=global_std, eps=norm.eps, unbiased=norm.unbiased, clip=adv_clip)
    if per_reward_weights:
        a, zero = combine_component_advantages(rollout.reward_components, per_reward_weights,
                                               rollout.group_index, **kw)
    else:
        a, zero = group_advantages(rollout.rewards, rollout.group_index, **kw)
    idx = rollout.transitions.sample_index
    return a[idx], {"zero_var": zero[idx], "zero_var_fraction": zero.float().mean().item()}
