"""Moved: the online DPO / GDRO updates are :mod:`flowrl.updates.preference` (re-exported here)."""
from __future__ import annotations

from ..updates.preference import T_MIN, DPOUpdate, GDROUpdate, grouped  # noqa: F401


def preference_update(trainer, rollout, it: int, pairwise: bool) -> dict:
    """One iteration of online DPO (``pairwise``) or GDRO on ``rollout`` -> averaged stats."""
    return trainer.update_object("dpo" if pairwise else "gdro")(rollout, it)[0]
