"""Wan2.1 text-to-video (Wan Team 2025) as a ``FlowPolicy`` (``model.pipeline: wan``): the Wan family's math
(:mod:`flowrl.pipelines.wan_family`) on Wan2.1's pipelines, T2V-1.3B and T2V-14B."""
from __future__ import annotations

from .wan_family import (DEFAULT_NUM_FRAMES, DEFAULT_RESOLUTION, TINY_NUM_FRAMES, WAN21_T2V_14B, WAN21_T2V_1_3B,
                         WAN_LORA_TARGET_MODULES, WanFamilyPolicy, wan_published)


class WanPolicy(WanFamilyPolicy):
    """``FlowPolicy`` for Wan2.1 text-to-video; its arguments are :class:`WanFamilyPolicy`'s."""

    kind = "wan"
    tiny_kinds = ("wan",)
    example_hub_id = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    published = {m.source: m for m in (
        wan_published(example_hub_id, WAN21_T2V_1_3B, "Wan2.1-T2V-1.3B", "wan-1.3b-arch"),
        wan_published("Wan-AI/Wan2.1-T2V-14B-Diffusers", WAN21_T2V_14B, "Wan2.1-T2V-14B", "wan-14b-arch"))}


__all__ = ["DEFAULT_NUM_FRAMES", "DEFAULT_RESOLUTION", "TINY_NUM_FRAMES", "WAN_LORA_TARGET_MODULES", "WanPolicy"]
