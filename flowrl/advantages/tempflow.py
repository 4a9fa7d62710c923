"""TempFlow-GRPO advantages and noise-aware step weights (SPEC section 5). Pure functions.

TempFlow-GRPO (He et al. 2025, arXiv 2508.04324) gives each stochastic transition
``x_k -> child b`` its own process reward ``R[b, k]`` (the reward of the child's ODE
completion, see :class:`flowrl.rollout.TempFlowSampler`), normalises it within a
(prompt, initial noise, step) column, and weights the clipped loss of step ``k`` by how much
noise the step injects.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..sde import sde_step
from .group import ADV_CLIP, GROUP_EPS, combine_component_advantages, group_advantages

GROUP_BY = ("seed", "prompt")


def step_noise_scales(sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
    """Standard deviation of every Flow-GRPO SDE step, ``std_t * sqrt(-dt_t)`` -> ``[T]`` float32.

    ``sigmas`` is a ``[T + 1]`` schedule ending in 0. The value is what
    :func:`flowrl.sde.sde_step` uses as its noise scale (it is computed by that function, so the
    two cannot drift apart): ``std_t = a sqrt(sigma_t / (1 - sigma'))`` with ``sigma' = sigma_next``
    when ``sigma_t == 1`` (Flow-GRPO, arXiv 2505.05470, eq. 9), in latent units per element.
    """
    s = torch.as_tensor(sigmas, dtype=torch.float32).flatten()  # [T + 1]
    if s.numel() < 2:
        raise ValueError(f"sigmas must hold at least 2 values (a [T + 1] schedule), got {s.numel()}")
    if not bool((s[1:] < s[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing (sigma_{i+1} < sigma_i)")
    t = s.numel() - 1
    dummy = torch.zeros(t, 1)  # [T, 1]: the scale does not depend on x or v
    return sde_step(dummy, dummy, s[:-1], s[1:], noise_level=float(noise_level)).std  # [T]


def noise_aware_weights(sigmas: torch.Tensor, noise_level: float, trained_steps: Sequence[int]) -> torch.Tensor:
    """Noise-aware loss weight of every step (TempFlow-GRPO, arXiv 2508.04324, SPEC section 5).

    ``w_t = (std_t sqrt(-dt_t)) / mean_{t' in trained}(std_t' sqrt(-dt_t'))`` for ``t`` in
    ``trained_steps``, so the weights **average 1 over the trained steps** (each trained step
    once, whatever the number of transitions stored per step); untrained steps get 0.

    Args:
        sigmas: ``[T + 1]`` schedule ending in 0 (``policy.sigmas(T)``).
        noise_level: Flow-GRPO's ``a`` (> 0). The normalised weights do not depend on it
            (``std_t`` is proportional to ``a``); the normaliser ``1 / mean`` does.
        trained_steps: distinct step indices in ``[0, T)``.
    Returns:
        ``[T]`` float32, indexed by step: ``weights[transitions.step]`` gives one per transition.

    For SD3.5-M settings (a = 0.7, shift 3, T = 10, diffusers schedule, steps 0..8) the
    normaliser ``1 / mean`` is 2.252 (a = 0.9: 1.752) and the weights are
    1.577, 1.673, 1.207, 1.004, 0.882, 0.795, 0.719, 0.635, 0.508: the second step is the
    largest, because the first step's ``std_t`` divides by ``1 - sigma_next`` instead of
    ``1 - sigma``.
    """
    if not noise_level > 0:
        raise ValueError(f"noise_level must be > 0 for noise-aware weights (0 injects no noise), got {noise_level}")
    scales = step_noise_scales(sigmas, noise_level)  # [T]
    t = scales.numel()
    steps = [int(k) for k in trained_steps]
    if not steps:
        raise ValueError("trained_steps is empty: pass at least one step index")
    if len(set(steps)) != len(steps):
        raise ValueError(f"trained_steps has duplicates: {steps}")
    bad = [k for k in steps if not 0 <= k < t]
    if bad:
        raise ValueError(f"trained_steps {bad} are outside [0, T={t})")
    idx = torch.tensor(steps, dtype=torch.long)  # [K]
    weights = torch.zeros(t, dtype=torch.float32)  # [T]
    weights[idx] = scales[idx] / scales[idx].mean()  # [K], mean over the K trained steps = 1
    return weights


def tempflow_groups(rollout, group_by: str) -> torch.Tensor:
    """Advantage group id of every transition ``[M]`` long.

    ``"seed"``: (prompt, initial noise, step), i.e. the ``branches`` children of one ODE latent
    ``x_k``; ``"prompt"``: (prompt, step), all seeds' children of step ``k`` together.
    """
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {GROUP_BY}, got {group_by!r}")
    ex = rollout.extras
    missing = [k for k in ("trajectory", "step") if k not in ex]
    if missing:
        raise ValueError(f"rollout.extras lacks {missing}: not a TempFlowSampler rollout "
                         f"(structure {rollout.structure!r})")
    row = ex["trajectory"] if group_by == "seed" else rollout.transitions.prompt_index  # [M] long
    step = ex["step"].long()  # [M]
    t = int(step.max().item()) + 1 if step.numel() else 1
    return row.long() * t + step  # [M] long, unique per (row, step)


def tempflow_structure(rollout, *, group_by: Optional[str] = None, global_std: bool = False,
                       per_reward_weights: Optional[dict] = None, **_: object) -> tuple[torch.Tensor, dict]:
    """Per-step process-reward advantages of a TempFlow rollout (arXiv 2508.04324, SPEC section 5).

    ``A[b, k] = (R[b, k] - mean(R[., k])) / (std(R[., k]) + 1e-4)`` within each group (see
    :func:`tempflow_groups`; population std as in Flow-GRPO), clipped to +-5. ``R[b, k]`` is the
    reward of the completion the transition leads to (``rewards[transitions.sample_index]``).

    Args:
        rollout: from :class:`flowrl.rollout.TempFlowSampler` (``structure="tempflow"``).
        group_by: ``"seed"`` or ``"prompt"``; None takes the sampler's (``rollout.extras["group_by"]``).
        global_std: divide by the std of all process rewards instead of the group's.
        per_reward_weights: normalise each reward component first, then weight (MixGRPO).
    Returns:
        ``(A [M] float32, info)``; ``info["zero_var"]`` [M] bool marks groups whose rewards
        are all equal (A = 0, skipped); ``info["zero_var_fraction"]`` and ``info["num_groups"]``
        are floats to log. The noise-aware weight is not applied here: it is
        ``rollout.transitions.weight``.
    """
    group_by = group_by or rollout.extras.get("group_by", "seed")
    groups = tempflow_groups(rollout, group_by)  # [M]
    idx = rollout.transitions.sample_index  # [M]
    if bool((idx < 0).any()):
        raise ValueError("every TempFlow transition must lead to exactly one completion (sample_index >= 0)")
    if per_reward_weights:
        comps = {k: v[idx] for k, v in rollout.reward_components.items()}  # name -> [M]
        adv, zero = combine_component_advantages(comps, per_reward_weights, groups, global_std=global_std)
    else:
        adv, zero = group_advantages(rollout.rewards[idx], groups, global_std=global_std,
                                     eps=GROUP_EPS, clip=ADV_CLIP)  # [M], [M]
    info = {"zero_var": zero, "zero_var_fraction": zero.float().mean().item() if zero.numel() else 0.0,
            "num_groups": float(torch.unique(groups).numel())}
    return adv.float(), info
