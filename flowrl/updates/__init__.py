"""Updates: what a trainer does with a rollout (online) or a dataset step (offline).

``UPDATES`` maps ``train.loss`` to an ``Update`` class (:mod:`flowrl.updates.base`); adding an update is
one new file here and one line below (docs/design.md, "How to add an update"). Each class declares what it
needs (:class:`~flowrl.updates.base.Needs`); this module answers the questions the rest of flowrl asks
about the registered updates from those declarations alone.
"""
from __future__ import annotations

from ..registry import Registry  # light: the classes import on first use

UPDATES = Registry("update", {  # in the order users read them (help, bench tables): transitions, samples, offline
    "grpo": "flowrl.updates.grpo:GRPOUpdate",
    "grpo_guard": "flowrl.updates.grpo_guard:GRPOGuardUpdate",
    "dppo": "flowrl.updates.dppo:DPPOUpdate",
    "gardo_grpo": "flowrl.updates.gardo:GARDOGRPOUpdate",
    "opd": "flowrl.updates.opd:OPDUpdate",
    "nft": "flowrl.updates.nft:NFTUpdate",
    "awm": "flowrl.updates.awm:AWMUpdate",
    "dgpo": "flowrl.updates.dgpo:DGPOUpdate",
    "gardo_nft": "flowrl.updates.gardo:GARDONFTUpdate",
    "dpo": "flowrl.updates.preference:DPOUpdate",
    "gdro": "flowrl.updates.preference:GDROUpdate",
    "offline_gdro": "flowrl.updates.offline_gdro:OfflineGDROUpdate",
    "sft": "flowrl.updates.sft:SFTUpdate",
    "dpo_offline": "flowrl.updates.dpo_offline:DPOOfflineUpdate",
})

DEFAULT_LOSS = {"online": "grpo", "offline": "offline_gdro", "sft": "sft"}  # train.loss when a recipe names none
MODE_ALIASES = {"sft": "offline"}  # train.mode shorthands: the mode they train in, with their DEFAULT_LOSS loss
MODE_INPUT = {"online": "rollout", "offline": "dataset"}  # what an update must consume in each train.mode


def default_needs(name: str):
    """The :class:`~flowrl.updates.base.Needs` of update ``name`` with its default options."""
    cls = UPDATES.get(name)
    return cls.needs(cls.Options())


def describe_updates() -> list[tuple[str, str]]:
    """``(name, summary)`` of every registered update, in registry order: what ``train.loss``'s help and the
    bench tables say (each update's own ``summary`` declaration)."""
    return [(name, UPDATES.get(name).summary) for name in UPDATES.entries]


def loss_help() -> str:
    """``train.loss``'s help: every registered update with its one-line summary."""
    listing = "; ".join(f"{name!r}: {summary}" for name, summary in describe_updates())
    return (f"the update (flowrl.updates.UPDATES, docs/algorithms.md): {listing}; empty = "
            f"{DEFAULT_LOSS['online']} online, {DEFAULT_LOSS['offline']} offline")


def updates_help() -> str:
    """The registered updates as ``flowrl train --help`` lists them: a line each, its name and its summary."""
    rows = "\n".join(f"  {name:<13} {summary}" for name, summary in describe_updates())
    return f"updates (train.loss=NAME; their options: train.loss_options):\n{rows}"


def updates_by_input() -> dict[str, list[str]]:
    """Registered update names by what they consume (``rollout``, ``dataset``) and, under ``samples``, the
    online ones that train on finished samples (any sampler); in registry order."""
    out: dict[str, list[str]] = {}
    for name in UPDATES.entries:
        needs = default_needs(name)
        out.setdefault(needs.consumes, []).append(name)
        if needs.consumes == "rollout" and needs.clean_samples:
            out.setdefault("samples", []).append(name)
    return out


def moved_key_table() -> dict[str, tuple[str, list[str]]]:
    """Keys that moved into updates' options (``Options.moved``) -> (the option, the updates that own it)."""
    from .base import moved_keys

    out: dict[str, tuple[str, list[str]]] = {}
    for name in UPDATES.entries:
        for key, opt in moved_keys(UPDATES.get(name).Options).items():
            out.setdefault(key, (opt, []))[1].append(name)
    return out


__all__ = ["UPDATES", "DEFAULT_LOSS", "MODE_ALIASES", "MODE_INPUT", "default_needs", "describe_updates", "loss_help",
           "updates_help", "updates_by_input", "moved_key_table"]
