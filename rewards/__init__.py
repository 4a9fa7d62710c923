"""Rewards (shipped as ``flowrl.rewards``): a registry of named reward builders.

A reward is anything callable as ``reward(images [B, 3, H, W] in [0, 1], prompts) -> float32 [B]``
(NaN = not applicable). ``build(name, **kwargs)`` makes one by name; ``build_multi({name: weight})``
a weighted combination. Heavy reward models are imported lazily, on first build.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch

from flowrl.registry import resolve_target

# name -> "module:attribute" (lazy: importing flowrl.rewards loads no reward model library)
REGISTRY: dict[str, str] = {
    "digits": "flowrl.rewards.digits:DigitsReward",
    "jpeg_compressibility": "flowrl.rewards.compress:JpegCompressibility",
    "jpeg_incompressibility": "flowrl.rewards.compress:JpegIncompressibility",
    "pickscore": "flowrl.rewards.pickscore:PickScore",
    "clipscore": "flowrl.rewards.clip:CLIPScore",
    "aesthetic": "flowrl.rewards.aesthetic:LaionAesthetic",
    "hps": "flowrl.rewards.hps:HPSv21",
    "imagereward": "flowrl.rewards.imagereward:ImageReward",
    "ocr": "flowrl.rewards.ocr:OCRReward",
    "vlm_judge": "flowrl.rewards.vlm:VLMJudge",
}


def register(name: str, target: Union[str, Callable]) -> None:
    """Add a reward builder: a ``"module:attr"`` string or a callable returning a reward."""
    REGISTRY[name] = target


def available() -> list[str]:
    return sorted(REGISTRY)


def _resolve(name: str) -> Callable:
    try:
        target = REGISTRY[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown reward {name!r}.{hint} Valid rewards: {', '.join(available())}") from None
    return target if callable(target) else resolve_target(target)


def build(name: str, **kwargs):
    """Build the reward registered under ``name`` with ``kwargs``."""
    return _resolve(name)(**kwargs)


class MultiReward:
    """Weighted sum of named rewards; ``components`` keeps each one for logging and for
    per-reward advantage normalisation (MixGRPO ``advantage_aggr``).

    NaN in a component with non-zero weight makes the total NaN for that image (not applicable).
    """

    def __init__(self, rewards: Mapping[str, Callable], weights: Mapping[str, float]):
        if set(rewards) != set(weights):
            raise ValueError(f"rewards {sorted(rewards)} and weights {sorted(weights)} must name the same rewards")
        if not rewards:
            raise ValueError("MultiReward needs at least one reward")
        self.rewards, self.weights = dict(rewards), {k: float(v) for k, v in weights.items()}
        self.name = "+".join(f"{w:g}*{k}" for k, w in self.weights.items())

    def components(self, images: torch.Tensor, prompts: list[str], **meta) -> dict[str, torch.Tensor]:
        return {k: torch.as_tensor(r(images, prompts, **meta)).float().cpu() for k, r in self.rewards.items()}

    def combine(self, comps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sum(self.weights[k] * comps[k] for k in self.weights if self.weights[k] != 0) \
            if any(self.weights.values()) else torch.zeros_like(next(iter(comps.values())))

    def __call__(self, images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
        return self.combine(self.components(images, prompts, **meta))


def build_multi(weights: Mapping[str, float], kwargs: Optional[Mapping[str, dict]] = None) -> MultiReward:
    """``{name: weight}`` (+ per-name kwargs) -> :class:`MultiReward`."""
    kwargs = kwargs or {}
    unknown = set(kwargs) - set(weights)
    if unknown:
        raise ValueError(f"reward options given for {sorted(unknown)}, which are not in the weights {sorted(weights)}")
    return MultiReward({k: build(k, **kwargs.get(k, {})) for k in weights}, weights)
