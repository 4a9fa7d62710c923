"""TempFlow-GRPO advantages and noise-aware step weights (docs/algorithms.md §5). Pure functions.

TempFlow-GRPO (He et al. 2025, arXiv 2508.04324) gives each stochastic transition
``x_k -> child b`` its own process reward ``R[b, k]`` (the reward of the child's ODE
completion, see :class:`flowrl.rollout.TempFlowSampler`), normalises it within a
(prompt, initial noise, step) column, and weights the clipped loss of step ``k`` by how much
noise the step injects. The ``*_tracker`` groupings reproduce the statistics of the TempFlow-GRPO
code (Flow-GRPO's per-prompt stat tracker on the table of process rewards, one column per step).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..structures import TempFlowStructure, layout_of
from .aggregate import Normalised, aggregate
from .group import ADV_CLIP, GROUP_EPS, group_normalised

# Advantage groupings of a TempFlow rollout (``TempFlowSampler.group_by`` /
# ``tempflow_structure(group_by=...)``). The ``*_tracker`` ones use Flow-GRPO's
# per-prompt stat tracker statistics, as the TempFlow-GRPO code does (see tracker_advantages).
GROUP_BY = ("seed", "prompt", "seed_tracker", "prompt_tracker")
TRACKER_GROUP_BY = ("seed_tracker", "prompt_tracker")


def prompt_text_ids(prompts: Sequence[str], prompt_index: torch.Tensor) -> torch.Tensor:
    """Dense id of each row's prompt **text** ``[M]`` long: rows whose prompts are equal strings share
    an id even when they are different entries of ``prompts`` (Flow-GRPO's tracker keys by text); a
    :class:`flowrl.data.items.PromptItem` by its ``key`` (text and source image)."""
    ids: dict[str, int] = {}
    per_prompt = torch.tensor([ids.setdefault(getattr(q, "key", str(q)), len(ids)) for q in prompts],
                              dtype=torch.long)  # [P] (an item's key: its text and source)
    return per_prompt[prompt_index.long()]  # [M]


def tempflow_groups(rollout, group_by: str) -> torch.Tensor:
    """Advantage group id of every transition ``[M]`` long.

    ``"seed"`` / ``"seed_tracker"``: (prompt, initial noise, step), i.e. the ``branches``
    children of one ODE latent ``x_k``; ``"prompt"``: (prompt, step), all seeds' children of
    step ``k`` together; ``"prompt_tracker"``: (prompt text, step), as ``"prompt"`` but rows
    whose prompts are the same string are pooled.
    """
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {GROUP_BY}, got {group_by!r}")
    layout = layout_of(rollout, TempFlowStructure)
    if group_by in ("seed", "seed_tracker"):
        row = layout.trajectory  # [M] long
    elif group_by == "prompt_tracker":
        row = prompt_text_ids(rollout.prompts, rollout.transitions.prompt_index)  # [M] long
    else:
        row = rollout.transitions.prompt_index  # [M] long
    step = layout.step.long()  # [M]
    t = int(step.max().item()) + 1 if step.numel() else 1
    return row.long() * t + step  # [M] long, unique per (row, step)


def tracker_normalised(rewards: torch.Tensor, groups: torch.Tensor, steps: torch.Tensor, *,
                       global_std: bool = False, eps: float = GROUP_EPS) -> Normalised:
    """:func:`tracker_advantages`' normalisation before its clip, float64 (as numpy in the tracker): per cell
    ``centred = R - mean_g(R)``, ``scale = std + eps`` (the cell's population std, or with ``global_std`` the
    std of the step's column); a constant cell and a non-finite reward get centred 0, scale 1 and ``zero``."""
    r = rewards.double()  # [M] float64 as numpy in the tracker
    valid = torch.isfinite(r)  # [M]
    centred, scale, zero = torch.zeros_like(r), torch.ones_like(r), ~valid  # [M] each
    col_std = {}
    if global_std:
        for k in torch.unique(steps).tolist():
            rk = r[(steps == k) & valid]  # [n_k]
            col_std[k] = rk.std(unbiased=False) if rk.numel() else r.new_zeros(())
    for gid in torch.unique(groups).tolist():
        m = (groups == gid) & valid  # [M]
        if not bool(m.any()):
            continue
        rg = r[m]  # [n_g]
        if bool((rg == rg[0]).all()):
            zero |= m
            continue  # constant cell: A = 0 (the tracker's (r - mean) / (0 + eps))
        k = int(steps[m][0])
        std = col_std[k] if global_std else rg.std(unbiased=False)
        centred[m], scale[m] = rg - rg.mean(), std + eps  # [n_g]
    return Normalised(centred, scale, zero)


def tracker_advantages(rewards: torch.Tensor, groups: torch.Tensor, steps: torch.Tensor, rows: torch.Tensor, *,
                       global_std: bool = False, eps: float = GROUP_EPS,
                       clip: float = ADV_CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """Process-reward advantages with Flow-GRPO's per-prompt stat tracker statistics (Flow-GRPO,
    arXiv 2505.05470: group-relative advantage, population std + 1e-4), as the TempFlow-GRPO
    code normalises its ``[rows, steps]`` table of process rewards (arXiv 2508.04324).

    Per cell ``g`` (a group at one step: ``groups`` already holds the step)::

        A = (R - mean_g(R)) / (std_g(R) + eps)          # population std, float64, eps = 1e-4
        A = (R - mean_g(R)) / (std_k(R) + eps)          # global_std: std of ALL rewards of step k

    clipped to ``+-clip``. Unlike :func:`flowrl.advantages.group_advantages`: the global std is
    taken per step column (not over all steps), a constant cell is not skipped but gets A = 0
    (and is still trained), and only a whole table **row** whose advantages are 0 at every step
    is skipped (``zero_var``), as the TempFlow-GRPO SD3 code drops such rows.

    Args:
        rewards: ``[M]`` process rewards, one per transition.
        groups: ``[M]`` long cell id (group x step, :func:`tempflow_groups`).
        steps: ``[M]`` long step index (columns for ``global_std``).
        rows: ``[M]`` long table row (the peer's sample: one (seed, branch) across its steps).
    Returns:
        ``(A [M] float32, zero_var [M] bool)``. Non-finite rewards are left out of every
        statistic and get A = 0 (the peer would propagate NaN).
    """
    adv = tracker_normalised(rewards, groups, steps, global_std=global_std, eps=eps).advantages(clip).float()  # [M]
    return adv, zero_rows(adv, rows)


def zero_rows(adv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[M]`` bool: the transition's table row has A == 0 at every one of its steps."""
    _, inv = torch.unique(rows, return_inverse=True)  # [M] dense row ids
    nonzero = torch.zeros(int(inv.max().item()) + 1 if inv.numel() else 0, dtype=torch.bool)  # [R]
    nonzero.index_put_((inv,), adv != 0, accumulate=True)
    return ~nonzero[inv]  # [M]


def tempflow_rows(rollout) -> torch.Tensor:
    """Table row of every transition ``[M]`` long: (seed trajectory, branch), the TempFlow-GRPO
    code's sample, which holds child ``b`` of every branch step of one initial noise."""
    layout = layout_of(rollout, TempFlowStructure)
    return layout.trajectory.long() * (int(layout.branch.max().item()) + 1) + layout.branch.long()  # [M]


def tempflow_structure(rollout, *, group_by: Optional[str] = None, global_std: bool = False,
                       per_reward_weights: Optional[dict] = None, reward_weights: Optional[dict] = None,
                       adv_clip: float = ADV_CLIP, **_: object) -> tuple[torch.Tensor, dict]:
    """Per-step process-reward advantages of a TempFlow rollout (arXiv 2508.04324, docs/algorithms.md §5).

    ``A[b, k] = (R[b, k] - mean(R[., k])) / (std(R[., k]) + 1e-4)`` within each group (see
    :func:`tempflow_groups`; population std as in Flow-GRPO), clipped to ``+-adv_clip`` (default 5).
    ``R[b, k]`` is the reward of the completion the transition leads to
    (``rewards[transitions.sample_index]``).

    Args:
        rollout: from :class:`flowrl.rollout.TempFlowSampler` (``structure="tempflow"``).
        group_by: one of :data:`GROUP_BY`; None takes the sampler's (``rollout.layout.group_by``).
            ``"seed"`` / ``"prompt"``: :func:`flowrl.advantages.group_advantages` per cell
            (constant cells skipped). ``"seed_tracker"`` / ``"prompt_tracker"``: the
            TempFlow-GRPO code's statistics (:func:`tracker_advantages`); ``"prompt_tracker"``
            is Flow-GRPO's ``PerPromptStatTracker`` on this rollout's table, ``"seed_tracker"``
            what it computes in the TempFlow-GRPO runs, whose per-process table holds one initial
            noise per prompt.
        global_std: divide by the std of all process rewards instead of the group's (tracker
            groupings: the std of all rewards of the same step).
        per_reward_weights: normalise each reward component first, then weight (MixGRPO; each process reward
            of a completion is its component's score, :func:`flowrl.advantages.aggregate`).
        reward_weights: ``reward.weights``, to split the weighted sum into each reward's contribution.
        adv_clip: advantage clip of every grouping (``train.loss_options.adv_clip_max``, default 5).
    Returns:
        ``(A [M] float32, info)``; ``info["zero_var"]`` [M] bool marks transitions without signal
        (skipped): groups whose rewards are all equal, or for the tracker groupings table rows
        with A = 0 at every step; ``info["zero_var_fraction"]`` and ``info["num_groups"]`` are
        floats to log; ``info["contributions"]`` name -> ``[M]`` (:mod:`flowrl.advantages.aggregate`). The
        noise-aware weight is not applied here: it is ``rollout.transitions.weight``.
    """
    layout = layout_of(rollout, TempFlowStructure)
    group_by = group_by or layout.group_by
    groups = tempflow_groups(rollout, group_by)  # [M]
    idx = rollout.transitions.sample_index  # [M]
    if bool((idx < 0).any()):
        raise ValueError("every TempFlow transition must lead to exactly one completion (sample_index >= 0)")
    if group_by in TRACKER_GROUP_BY:
        steps = layout.step.long()  # [M]
        normalise = lambda r: tracker_normalised(r, groups, steps, global_std=global_std)  # noqa: E731
    else:
        normalise = lambda r: group_normalised(r, groups, global_std=global_std, eps=GROUP_EPS)  # noqa: E731
    comps = {k: v[idx] for k, v in getattr(rollout, "reward_components", {}).items()}  # name -> [M] process rewards
    agg = aggregate(normalise, rollout.rewards[idx], comps, per_reward_weights or reward_weights,
                    bool(per_reward_weights), adv_clip)
    adv = agg.advantages.float()  # [M]
    # the tracker skips a table row only when its advantages are 0 at every step (a constant cell still trains)
    zero = zero_rows(adv, tempflow_rows(rollout)) if group_by in TRACKER_GROUP_BY else agg.zero  # [M]
    info = {"zero_var": zero, "zero_var_fraction": zero.float().mean().item() if zero.numel() else 0.0,
            "num_groups": float(torch.unique(groups).numel()), "contributions": agg.contributions}
    return adv, info
