"""Advantages: rewards + rollout structure -> one advantage per transition.

``ADVANTAGES[rollout.structure](rollout, **options) -> (advantages [M], info)`` is the only
thing a new sampler adds for the trainer to train on it (DESIGN.md). ``info`` may hold
``zero_var`` ([M] bool: no signal, skipped), ``train_mask`` ([M] bool: pruned transitions
are False) and scalars to log. One module per structure; the math is pure functions.
"""
from __future__ import annotations

from typing import Callable

import torch

from .group import ADV_CLIP, GROUP_EPS, combine_component_advantages, group_advantages, group_structure

AdvantageFn = Callable[..., tuple[torch.Tensor, dict]]
ADVANTAGES: dict[str, AdvantageFn] = {"group": group_structure}
# structures whose module loads on first use: name -> "module:function"
_LAZY = {"branch": "flowrl.advantages.tree:branch_structure",
         "tempflow": "flowrl.advantages.tempflow:tempflow_structure"}


def register(structure: str, fn: AdvantageFn) -> None:
    ADVANTAGES[structure] = fn


def transition_advantages(rollout, **options) -> tuple[torch.Tensor, dict]:
    """One advantage per transition of ``rollout`` [M], and info (see module docstring)."""
    if rollout.structure not in ADVANTAGES and rollout.structure in _LAZY:
        import importlib

        mod, attr = _LAZY[rollout.structure].split(":")
        ADVANTAGES[rollout.structure] = getattr(importlib.import_module(mod), attr)
    try:
        fn = ADVANTAGES[rollout.structure]
    except KeyError:
        raise ValueError(f"no advantage function for rollout structure {rollout.structure!r}; "
                         f"registered: {sorted(set(ADVANTAGES) | set(_LAZY))}") from None
    return fn(rollout, **options)
