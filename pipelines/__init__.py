"""Model adapters (shipped as ``flowrl.pipelines``): one file per model family, each a ``FlowPolicy``.

``build_policy(name, path, **kwargs)`` loads one by pipeline name; heavy modules load lazily.
"""
from __future__ import annotations

import importlib
from typing import Callable, Union

# name -> "module:callable(path, **kwargs) -> FlowPolicy"
REGISTRY: dict[str, str] = {
    "digits": "flowrl.pipelines.digits:load_digits_policy",
    "sd3": "flowrl.pipelines.sd3:SD3Policy.from_pretrained",
    "flux": "flowrl.pipelines.flux:FluxPolicy.from_pretrained",
}


def available() -> list[str]:
    return sorted(REGISTRY)


def build_policy(name: str, path=None, **kwargs):
    """Load the policy of pipeline ``name`` from ``path`` (a directory or hub id)."""
    try:
        target: Union[str, Callable] = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown pipeline {name!r}; valid pipelines: {', '.join(available())}") from None
    if callable(target):
        return target(path, **kwargs)
    mod, attr = target.split(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj(path, **kwargs)
