"""Group advantages (Flow-GRPO / DanceGRPO / MixGRPO, SPEC section 3). Pure functions."""
from __future__ import annotations

from typing import Callable, Optional

import torch

ADV_CLIP = 5.0
GROUP_EPS = 1e-4  # Flow-GRPO: A = (r - mean) / (std + 1e-4)


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, global_std: bool = False,
                     eps: float = GROUP_EPS, clip: float = ADV_CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group normalised rewards (Flow-GRPO / DanceGRPO, SPEC section 3).

    Args:
        rewards: ``[N]`` float32, already gathered over all processes.
        groups: ``[N]`` long group id (prompt, or prompt x seed).
        global_std: divide by the std of the whole batch instead of the group's.
    Returns:
        ``(A [N] float32 clipped to +-clip, zero_var [N] bool)``: ``zero_var`` marks samples
        whose group rewards are all equal (A = 0, no signal; the trainer skips them).
        Std is the population std (``unbiased=False``, as numpy's in Flow-GRPO). NaN rewards
        are ignored in the statistics and get A = 0.
    """
    r = rewards.float()
    valid = torch.isfinite(r)
    adv = torch.zeros_like(r)
    zero_var = torch.zeros_like(r, dtype=torch.bool)
    gstd = r[valid].std(unbiased=False) if global_std and valid.sum() > 1 else None
    for gid in torch.unique(groups):
        m = (groups == gid) & valid
        if m.sum() == 0:
            zero_var |= groups == gid
            continue
        rg = r[m]
        if rg.numel() < 2 or (rg.max() - rg.min()).abs() <= 1e-12 * max(1.0, rg.abs().max().item()):
            zero_var |= groups == gid
            continue
        std = gstd if gstd is not None else rg.std(unbiased=False)
        adv[m] = (rg - rg.mean()) / (std + eps)
    return adv.clamp(-clip, clip), zero_var


def combine_component_advantages(components: dict[str, torch.Tensor], weights: dict[str, float],
                                 groups: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """MixGRPO ``advantage_aggr``: normalise each reward within its groups, then weight and sum.

    A sample is zero-variance only if it is so for every component.
    """
    total, zero = None, None
    for name, r in components.items():
        a, z = group_advantages(r, groups, **kw)
        total = weights[name] * a if total is None else total + weights[name] * a
        zero = z if zero is None else zero & z
    return total, zero


def group_structure(rollout, *, global_std: bool = False, per_reward_weights: Optional[dict] = None,
                     **_: object) -> tuple[torch.Tensor, dict]:
    if per_reward_weights:
        a, zero = combine_component_advantages(rollout.reward_components, per_reward_weights,
                                               rollout.group_index, global_std=global_std)
    else:
        a, zero = group_advantages(rollout.rewards, rollout.group_index, global_std=global_std)
    idx = rollout.transitions.sample_index
    return a[idx], {"zero_var": zero[idx], "zero_var_fraction": zero.float().mean().item()}
