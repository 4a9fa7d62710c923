"""FLUX.1 Kontext (image editing: Labs et al. 2025) as a ``FlowPolicy``, over diffusers ``FluxKontextPipeline``.

Kontext is a FLUX.1 transformer that also attends to a **source image**: the source is encoded by
the VAE (the posterior's mode, ``(z - shift_factor) * scaling_factor``), packed into 2x2-patch
tokens like the generated latents and appended to the generated tokens; its RoPE ids are the
generated grid's with the first coordinate 1 instead of 0 (``FluxKontextPipeline.prepare_latents``).
The transformer runs on ``[generated tokens, source tokens]`` and the velocity is its output over
the generated tokens only. Everything else (unpacked ``[B, 16, h, w]`` latents, the text
encoders, embedded guidance, optional true CFG whose two halves share the source tokens, the
dynamic-shift schedule over the *generated* token count, decoding) is FLUX.1's
(``pipelines/flux_family.py``).

How a prompt carries its source image (the conditioning seam, :mod:`flowrl.conditions`): the
adapter receives texts and sources separately. ``encode_prompts(texts)`` is FLUX's text conditioning
(so every text-only sampler and recipe runs on Kontext unchanged, as the pipeline with
``image=None``); for a batch whose rows carry source images, ``flowrl.conditions.encode_conditions``
adds :meth:`FluxKontextPolicy.source_conditioning` ``(texts, sources)``, one source per row
(``max_sources = 1``: the pipeline takes one image), every row or none. A source is float RGB in
[0, 1] of any size, resized to the policy's resolution (``height`` x ``width``) and normalised by
the pipeline's own ``image_processor.preprocess`` (what the pipeline does with ``_auto_resize=False``
at that size; Flow-GRPO resizes sources to the training resolution too), then encoded by
:meth:`encode_sources`. The conditioning then holds ``image_latents`` ``[B, 16, h, w]`` (unpacked,
like the latents) beside the text entries: batch-first like every entry, so
``flowrl.types.index_cond`` gives each transition its source. Without a source it holds no
``image_latents`` and ``velocity`` is FLUX's.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .base import IMAGE_SIZE
from .common import cfg_combine, cfg_halves, module_dtype, transformer_dtype
from .facts import ModelConfigs
from .flux_family import FLUX1_DEV, FLUX_DEV, FLUX_LORA_TARGET_MODULES, FluxFamilyPolicy
from .packing import latent_image_ids, pack_latents

# Flow-GRPO's LoRA targets for FLUX.1 Kontext (scripts/train_flux_kontext.py): FLUX's (both streams'
# attention projections and feed-forwards) plus the single-stream blocks' MLP input ``proj_mlp``.
FLUX_KONTEXT_LORA_TARGET_MODULES = FLUX_LORA_TARGET_MODULES + ("proj_mlp",)


class FluxKontextPolicy(FluxFamilyPolicy):
    """``FlowPolicy`` for FLUX.1 Kontext (see module doc; the arguments are ``FluxFamilyPolicy``'s: the
    pipeline's ``guidance_scale`` default is 3.5, Kontext-dev is guidance-distilled)."""

    kind = "flux-kontext"
    pipeline_class = "FluxKontextPipeline"
    lora_target_modules = FLUX_KONTEXT_LORA_TARGET_MODULES
    tiny_kinds = ("flux-kontext",)
    max_sources = 1  # source images per prompt (FluxKontextPipeline takes one image)
    # prompts without a source run as text-to-image, as FluxKontextPipeline does with image=None (its latents
    # alone, no image_latents); flowrl.conditions.check_sources says so before such a run starts
    needs_sources = False
    example_hub_id = "black-forest-labs/FLUX.1-Kontext-dev"
    # Published configs of black-forest-labs/FLUX.1-Kontext-dev: FLUX.1-dev's (pipelines/flux_family.py). Black Forest
    # Labs' reference code (black-forest-labs/flux, src/flux/util.py, configs["flux-dev-kontext"]) gives the
    # Kontext transformer FLUX.1-dev's parameters exactly (64 packed channels, 19 double + 38 single blocks, 24
    # heads of 128, guidance embedding) and the same autoencoder; the repository's diffusers text_encoder /
    # text_encoder_2 are FLUX.1-dev's CLIP-L and T5-XXL (DiffSynth-Studio loads Kontext's DiT with FLUX.1-dev's
    # encoders and VAE)
    published = {example_hub_id: ModelConfigs(
        FLUX_DEV, FLUX1_DEV.text_encoders, FLUX1_DEV.vae, example_hub_id, "FLUX.1 Kontext [dev]",
        "flux-kontext-arch")}

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """FLUX's text entries plus the source's ``image_latents`` ``[rows, C, h, w]`` at the result's size
        (what an editing batch holds): the transformer then runs on twice the image tokens."""
        cond = super().example_conditioning(configs, geometry, rows, device, dtype)
        cond["image_latents"] = torch.empty(rows, *geometry.latent_shape, device=device, dtype=dtype)  # [B, C, h, w]
        return cond

    @classmethod
    def tiny_components(cls, kind: str = "flux-kontext", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """The tiny FLUX.1-dev-like components (``FluxFamilyPolicy.tiny_components("flux")``: guidance
        embedding, dynamic shift); ``FluxKontextPipeline`` takes the same components."""
        return FluxFamilyPolicy.tiny_components("flux", image_size, seed)

    # --- conditioning ----------------------------------------------------------------------
    def encode_sources(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Source images (each float ``[3, H, W]`` in [0, 1]) -> ``image_latents`` float32 ``[B, 16, h, w]``
        at the policy's resolution: the pipeline's resize + normalisation, the VAE posterior's mode,
        ``(z - shift_factor) * scaling_factor``. No gradients (the VAE is frozen)."""
        pixels = self.pipe.image_processor.preprocess([im.float().cpu() for im in images], self.height, self.width)
        cfg = self.vae.config
        with torch.no_grad():
            z = self.vae.encode(pixels.to(self.device, module_dtype(self.vae))).latent_dist.mode()  # [B, 16, h, w]
        return ((z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor).float()  # [B, 16, h, w]

    def source_conditioning(self, texts: list[str], sources: Sequence[tuple]) -> dict[str, torch.Tensor]:
        """The conditioning entries of the rows' source images (``flowrl.conditions.encode_conditions`` adds
        them to the text's, which the text-embedding cache may serve): ``image_latents`` [B, 16, h, w].
        Every row carries exactly one source (``max_sources = 1``; a batch is all edits or all text)."""
        counts = [len(s) for s in sources]
        if any(c != 1 for c in counts):
            raise ValueError(f"{sum(c > 0 for c in counts)} of {len(counts)} prompts carry a source image; FLUX.1 "
                             f"Kontext conditions a batch on one source per prompt, all or none (split the prompt set)")
        return {"image_latents": self.encode_sources([s[0] for s in sources])}

    # --- FlowPolicy ----------------------------------------------------------------------
    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, guidance_scale=3.5, **settings):
        kw = super().transformer_inputs(config, dtype, x, sigma, cond, guidance_scale=guidance_scale)
        src = cond.get("image_latents")
        if src is not None:  # the source's packed tokens appended, their ids with first coordinate 1
            hs, ws = src.shape[-2:]
            if hs % 2 or ws % 2:
                raise ValueError(f"FLUX Kontext latents need even height and width (2x2 packing), got source {tuple(src.shape)}")
            src_ids = latent_image_ids(hs, ws, x.device, dtype)
            src_ids[:, 0] = 1
            kw["hidden_states"] = torch.cat([kw["hidden_states"], pack_latents(src.to(x.device, torch.float32)).to(dtype)], 1)
            kw["img_ids"] = torch.cat([kw["img_ids"], src_ids])
        return kw

    @classmethod
    def transformer_output(cls, out, x):
        n = (x.shape[-2] // 2) * (x.shape[-1] // 2)  # the generated tokens
        return super().transformer_output(out[:, :n], x)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        if "image_latents" not in cond:
            return super().velocity(latents, sigma, cond)
        x = latents.to(self.device)  # [B, C, h, w]
        src = cond["image_latents"].to(self.device, torch.float32)  # [B, C, hs, ws]
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        dtype = transformer_dtype(self.transformer)
        config = getattr(self.transformer, "module", self.transformer).config

        def fwd(xx, s, pe, pooled, image):
            kw = self.transformer_inputs(config, dtype, xx, s, {"prompt_embeds": pe, "pooled_prompt_embeds": pooled,
                                                               "image_latents": image}, **self.forward_settings())
            return self.transformer_output(self.transformer(**kw)[0], xx)

        text = (x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"], src)
        if self.true_cfg_scale == 1.0:
            return fwd(*text).float()
        u, c = cfg_halves(fwd, (x, sigma, cond["negative_prompt_embeds"], cond["negative_pooled_prompt_embeds"], src),
                          text, uncond_grad=self.cfg_uncond_grad)
        return cfg_combine(u, c, self.true_cfg_scale, uncond_grad=self.cfg_uncond_grad)


__all__ = ["FLUX_KONTEXT_LORA_TARGET_MODULES", "FluxKontextPolicy"]
