"""Updates: what a trainer does with a rollout (online) or a dataset step (offline).

``UPDATES`` maps ``train.loss`` to an ``Update`` class (:mod:`flowrl.updates.base`); adding an update is
one new file here and one line below (docs/design.md). Each class declares what it consumes
(``rollout``: called ``update(rollout, iteration) -> (stats, advantage info)`` by the online trainer;
``dataset``: ``update(passes, step) -> stats`` by the offline trainer) and what else it needs.
"""
from __future__ import annotations

from ..registry import Registry  # light: the classes import on first use

UPDATES = Registry("update", {
    "grpo": "flowrl.updates.grpo:GRPOUpdate",
    "nft": "flowrl.updates.nft:NFTUpdate",
    "dpo": "flowrl.updates.preference:DPOUpdate",
    "gdro": "flowrl.updates.preference:GDROUpdate",
    "grpo_guard": "flowrl.updates.grpo_guard:GRPOGuardUpdate",
    "offline_gdro": "flowrl.updates.offline_gdro:OfflineGDROUpdate",
})

DEFAULT_LOSS = {"online": "grpo", "offline": "offline_gdro"}  # train.loss when a recipe names none, by train.mode


def updates_by_input() -> dict[str, list[str]]:
    """Registered update names by what they consume (``rollout``, ``dataset``), in registry order."""
    out: dict[str, list[str]] = {}
    for name in UPDATES.entries:
        out.setdefault(UPDATES.get(name).consumes, []).append(name)
    return out


__all__ = ["UPDATES", "DEFAULT_LOSS", "updates_by_input"]
