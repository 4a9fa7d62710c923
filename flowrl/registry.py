"""The one registry of named things (samplers, updates, pipelines, rewards, advantage functions, step
functions, quantization backends): a name -> target mapping whose targets are ``"module:attr"`` strings
(imported on first use) or objects, and whose errors list the valid names and suggest the closest."""
from __future__ import annotations

import difflib
import importlib
from collections.abc import MutableMapping
from typing import Any, Iterator, Union

_MISSING = object()


def resolve_target(target: str) -> Any:
    """The object a ``"package.module:attr"`` (or ``"module:Class.attr"``) string names, imported now."""
    mod, attr = target.split(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(MutableMapping):
    """``Registry(kind, {name: target})``: ``get(name)`` is the target (a ``"module:attr"`` string imported
    on first use, or the object itself); ``registry[name]`` is the target as registered. An unknown name
    is a ``ValueError`` naming the closest valid one and listing them all (``check``)."""

    def __init__(self, kind: str, entries: dict[str, Union[str, Any]]):
        self.kind, self.entries = kind, dict(entries)
        self._resolved: dict[str, Any] = {}

    def register(self, name: str, target: Union[str, Any]) -> None:
        self[name] = target

    def names(self) -> list[str]:
        return sorted(self.entries)

    def check(self, name: str) -> None:
        if name not in self.entries:
            close = difflib.get_close_matches(str(name), list(self.entries), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}.{hint} Valid {self.kind}s: {', '.join(self.names())}")

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The object registered as ``name`` (imported on first use); an unknown name raises (``check``)
        unless a ``default`` is given."""
        if default is not _MISSING and name not in self.entries:
            return default
        self.check(name)
        if name not in self._resolved:
            target = self.entries[name]
            self._resolved[name] = resolve_target(target) if isinstance(target, str) else target
        return self._resolved[name]

    # the mapping of names to registered targets
    def __getitem__(self, name: str) -> Any:
        return self.entries[name]

    def __setitem__(self, name: str, target: Union[str, Any]) -> None:
        self.entries[name] = target
        self._resolved.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self.entries[name]
        self._resolved.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


SAMPLERS = Registry("sampler", {
    "group": "flowrl.rollout.group:GroupSampler",
    "branch": "flowrl.rollout.branch:BranchSampler",
    "tempflow": "flowrl.rollout.tempflow:TempFlowSampler",
    "sol": "flowrl.rollout.sol:SolSampler",
    "ode": "flowrl.rollout.ode:ODEGroupSampler",
})
