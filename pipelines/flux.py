"""FLUX.1 (dev / schnell) as a ``FlowPolicy``, over diffusers ``FluxPipeline`` components.

The model is the FLUX.1 family's (``pipelines/flux_family.py``: unpacked ``[B, 16, h, w]`` latents
packed into 2x2-patch tokens inside ``velocity``, CLIP-L + T5-XXL text encoders, embedded guidance
for guidance-distilled models (dev) and optional true CFG, the pipeline's dynamic-shift schedule);
this file declares the ``FluxPipeline`` adapter: its name, tiny models and published configs.
"""
from __future__ import annotations

from .flux_family import FLUX1_DEV, FluxFamilyPolicy


class FluxPolicy(FluxFamilyPolicy):
    """``FlowPolicy`` for FLUX.1 [dev] / [schnell]; the arguments are ``FluxFamilyPolicy``'s (guidance
    embedded at ``guidance_scale`` 3.5 for dev, ignored by schnell; ``true_cfg_scale`` 1.0 = no real CFG)."""

    kind = "flux"
    pipeline_class = "FluxPipeline"
    tiny_kinds = ("flux", "flux-schnell")  # FLUX.1-dev-like (guidance embedding, dynamic shift), schnell-like
    example_hub_id = "black-forest-labs/FLUX.1-dev"
    published = {FLUX1_DEV.source: FLUX1_DEV}


__all__ = ["FluxPolicy"]
