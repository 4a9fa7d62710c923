"""FLUX.2 [klein] (Black Forest Labs 2026; 4B and 9B) as a ``FlowPolicy``, over diffusers ``Flux2KleinPipeline``.

The model is the FLUX.2 family's (``pipelines/flux2_family.py``: unpacked ``[B, 32, h, w]`` latents in
the VAE's batch-norm space, 2x2 packing with 4-axis RoPE ids inside ``velocity``, the empirical-``mu``
schedule); this file declares the ``Flux2KleinPipeline`` adapter. Its text encoder is Qwen3 (Qwen3-4B for
the 4B models, Qwen3-8B for the 9B ones; ``Qwen3ForCausalLM`` used as a text encoder): each prompt in
Qwen3's chat template with thinking off, the hidden states of layers 9, 18 and 27 stacked per token.

Two kinds of checkpoint share each size: the **base** models (``FLUX.2-klein-base-4B`` / ``-9B``: real
classifier-free guidance against the empty prompt at ``guidance_scale`` > 1, the models BFL publishes for
fine-tuning) and the **step-distilled** ones (``FLUX.2-klein-4B`` / ``-9B``, ``is_distilled`` in the
pipeline config: 4 steps, no guidance, ``guidance_scale`` ignored as the pipeline ignores it). Which one
a directory holds is the pipeline's own config; ``flowrl plan`` picks the size from ``model.path``.
"""
from __future__ import annotations

import torch

from .base import IMAGE_SIZE
from .components import QWEN3_4B
from .facts import Component, ModelConfigs
from .flux2_family import FLUX2_VAE, Flux2FamilyPolicy

# Published configs (the repositories' */config.json). transformer/config.json as diffusers'
# scripts/convert_flux2_to_diffusers.py writes it: "klein-4b" 5 double + 20 single blocks, 24 heads of 128 (3072
# wide), text features 7680 = 3 x 2560 (Qwen3-4B); "klein-9b" 8 double + 24 single blocks, 32 heads of 128 (4096
# wide), text features 12288 = 3 x 4096 (Qwen3-8B); no guidance embedding. The base and the distilled
# checkpoint of a size share the architecture.
_KLEIN = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256, mlp_ratio=3.0,
              axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=False)
FLUX2_KLEIN_4B = dict(_KLEIN, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680)
FLUX2_KLEIN_9B = dict(_KLEIN, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288)
# Qwen/Qwen3-8B config.json (36 layers, 4096 wide, 32 query / 8 KV heads of 128, untied output head): the 9B
# models' text_encoder/config.json (Qwen3ForCausalLM); the 4B models' is Qwen3-4B (pipelines/components.py)
QWEN3_8B = dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
TEXT_LAYERS = 27  # the pipeline stacks hidden states 9, 18 and 27: a tiny encoder needs 27 layers


def _published(size: str, transformer: dict, text_encoder: dict, arch: str) -> dict[str, ModelConfigs]:
    """The base and the distilled repository of one size (the distilled one last: it titles ``arch``)."""
    out = {}
    for name in (f"FLUX.2-klein-base-{size}", f"FLUX.2-klein-{size}"):
        hub_id = f"black-forest-labs/{name}"
        out[hub_id] = ModelConfigs(transformer, {"text_encoder": Component("transformers:Qwen3ForCausalLM", text_encoder)},
                                   Component("diffusers:AutoencoderKLFlux2", FLUX2_VAE), hub_id, name, arch)
    return out


class Flux2KleinPolicy(Flux2FamilyPolicy):
    """``FlowPolicy`` for FLUX.2 [klein]; the arguments are ``Flux2FamilyPolicy``'s (``guidance_scale`` 4.0: real
    CFG against ``negative_prompt`` ``""`` for a base model, ignored by a distilled one; ``max_sequence_length`` 512)."""

    kind = "flux2-klein"
    pipeline_class = "Flux2KleinPipeline"
    # the base models' layout (real CFG), then the step-distilled one (is_distilled: no guidance)
    tiny_kinds = ("flux2-klein", "flux2-klein-distilled")
    example_hub_id = "black-forest-labs/FLUX.2-klein-base-4B"
    published = {**_published("4B", FLUX2_KLEIN_4B, QWEN3_4B, "flux2-klein-arch"),
                 **_published("9B", FLUX2_KLEIN_9B, QWEN3_8B, "flux2-klein-9b-arch")}

    @classmethod
    def cfg_rows(cls, guidance_scale: float, options: dict) -> int:
        """Real CFG (a base model at ``guidance_scale`` > 1) doubles the batch; a distilled model's recipe sets 1.0."""
        return 2 if guidance_scale > 1.0 else 1

    @classmethod
    def tiny_components(cls, kind: str = "flux2-klein", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``Flux2KleinPipeline``: ``Flux2FamilyPolicy.tiny_parts`` without a guidance embedding, a
        ``Qwen3ForCausalLM`` of 27 layers 16 wide (the pipeline reads layers 9, 18, 27: text features 48) over
        ``build_qwen_tokenizer(qwen3=True)``; ``"flux2-klein-distilled"`` sets ``is_distilled``."""
        from .tiny import build_qwen_tokenizer, qwen3_encoder

        tok = build_qwen_tokenizer(qwen3=True)
        torch.manual_seed(seed + 3)
        text_encoder = qwen3_encoder("Qwen3ForCausalLM", tok, TEXT_LAYERS)
        return dict(**cls.tiny_parts(image_size, seed, 3 * 16, guidance_embeds=False), text_encoder=text_encoder,
                    tokenizer=tok, is_distilled=kind == "flux2-klein-distilled")


__all__ = ["FLUX2_KLEIN_4B", "FLUX2_KLEIN_9B", "QWEN3_8B", "Flux2KleinPolicy"]
