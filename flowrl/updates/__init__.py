"""Updates: what a trainer does with a rollout (online) or a dataset step (offline).

``UPDATES`` maps ``train.loss`` to an ``Update`` class (:mod:`flowrl.updates.base`); adding an update is
one new file here and one line below (docs/design.md). Online updates are called
``update(rollout, iteration) -> (stats, advantage info)``; ``offline_gdro`` is the offline trainer's step.
"""
from __future__ import annotations

from ..registry import Registry  # light: the classes import on first use (config validation stays cheap)

UPDATES = Registry("update", {
    "grpo": "flowrl.updates.grpo:GRPOUpdate",
    "nft": "flowrl.updates.nft:NFTUpdate",
    "dpo": "flowrl.updates.preference:DPOUpdate",
    "gdro": "flowrl.updates.preference:GDROUpdate",
    "grpo_guard": "flowrl.updates.grpo_guard:GRPOGuardUpdate",
    "offline_gdro": "flowrl.updates.offline_gdro:OfflineGDROUpdate",
})

OFFLINE_UPDATES = ("offline_gdro",)  # run by the offline trainer (train.mode: offline), not train.loss


def online_losses() -> tuple[str, ...]:
    """The ``train.loss`` values: every registered update except the offline ones."""
    return tuple(n for n in UPDATES.entries if n not in OFFLINE_UPDATES)


__all__ = ["UPDATES", "OFFLINE_UPDATES", "online_losses"]
