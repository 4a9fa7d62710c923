"""Lazy name -> object registries with errors that list the valid names."""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Union


def resolve_target(target: str) -> Any:
    """The object a ``"package.module:attr"`` (or ``"module:Class.attr"``) string names, imported now."""
    mod, attr = target.split(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry:
    """Maps names to ``"module:attr"`` strings (imported on first use) or objects."""

    def __init__(self, kind: str, entries: dict[str, Union[str, Any]]):
        self.kind, self.entries = kind, dict(entries)

    def register(self, name: str, target: Union[str, Any]) -> None:
        self.entries[name] = target

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def check(self, name: str) -> None:
        if name not in self.entries:
            close = difflib.get_close_matches(str(name), self.entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}.{hint} Valid {self.kind}s: {', '.join(self.names())}")

    def get(self, name: str) -> Any:
        self.check(name)
        target = self.entries[name]
        if isinstance(target, str):
            self.entries[name] = target = resolve_target(target)
        return target


SAMPLERS = Registry("sampler", {
    "group": "flowrl.rollout.group:GroupSampler",
    "branch": "flowrl.rollout.branch:BranchSampler",
    "tempflow": "flowrl.rollout.tempflow:TempFlowSampler",
    "sol": "flowrl.rollout.sol:SolSampler",
    "ode": "flowrl.rollout.ode:ODEGroupSampler",
})
