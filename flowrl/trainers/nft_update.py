"""Moved: the DiffusionNFT update is :mod:`flowrl.updates.nft` (re-exported here for old imports)."""
from __future__ import annotations

from ..updates.nft import T_MIN, NFTUpdate, OldPolicy  # noqa: F401


def nft_update(trainer, rollout, it: int) -> dict:
    """One iteration of DiffusionNFT on ``rollout`` with ``trainer``'s update -> averaged stats."""
    return trainer.update_object("nft")(rollout, it)[0]
