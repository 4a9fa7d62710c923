"""Advantages: rewards + rollout structure -> one advantage per transition.

``ADVANTAGES[rollout.structure](rollout, **options) -> (advantages [M], info)`` is the only
thing a new sampler adds for the trainer to train on it (docs/design.md). The advantages come back
clipped to ``+-adv_clip`` (``train.loss_options.adv_clip_max``): each function clips where its own math needs
it (before pruning, per reward), and the update uses them as they are. ``rollout.structure``
is the ``name`` of the rollout's typed record ``rollout.layout`` (:mod:`flowrl.structures`:
``GroupStructure``, ``TreeStructure``, ``TempFlowStructure``, ...), which the function reads with
:func:`flowrl.structures.layout_of`. ``info`` may hold ``zero_var`` ([M] bool: no signal,
skipped), ``train_mask`` ([M] bool: pruned transitions are False) and scalars to log. One module
per structure; the math is pure functions.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..registry import Registry
from .group import ADV_CLIP, GROUP_EPS, combine_component_advantages, group_advantages, group_structure
from .tempflow import tempflow_structure
from .tree import branch_structure, depthwise_advantages, fuse_rewards

AdvantageFn = Callable[..., tuple[torch.Tensor, dict]]
ADVANTAGES = Registry("rollout structure", {"group": group_structure, "branch": branch_structure,
                                            "tempflow": tempflow_structure})

__all__ = ["ADVANTAGES", "ADV_CLIP", "GROUP_EPS", "register", "transition_advantages", "group_advantages",
           "combine_component_advantages", "fuse_rewards", "depthwise_advantages"]


def register(structure: str, fn: AdvantageFn) -> None:
    """Serve rollouts whose ``layout.name`` is ``structure`` with ``fn(rollout, **options)``."""
    ADVANTAGES.register(structure, fn)


def transition_advantages(rollout, **options) -> tuple[torch.Tensor, dict]:
    """One advantage per transition of ``rollout`` [M], and info (see module docstring).

    Dispatches on ``rollout.structure`` (``rollout.layout.name`` for a :class:`flowrl.rollout.Rollout`;
    a duck-typed view of group rewards may carry the name alone)."""
    return ADVANTAGES.get(rollout.structure)(rollout, **options)
