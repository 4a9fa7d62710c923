"""Qwen-Image-Edit-2509 / 2511 (one to three source images per prompt) as a ``FlowPolicy``, over diffusers
``QwenImageEditPlusPipeline``.

The transformer is Qwen-Image's (``QwenImageTransformer2DModel``; 2511 sets ``zero_cond_t``: the
source tokens are modulated at timestep 0), and so is everything that does not see a source: the
unpacked ``[B, 16, h, w]`` latents, the schedule over the *generated* token count, true CFG with the
norm rescale, the video VAE's decoding (:class:`flowrl.pipelines.qwen_family.QwenFamilyPolicy`).

The sources, as ``QwenImageEditPlusPipeline.__call__`` prepares them (reproduced row by row; the
pipeline itself takes one prompt per call). Each source, a float ``[3, H, W]`` in [0, 1], becomes the
8-bit RGB image the pipeline takes (a PIL image), and then, at its own aspect ratio ``r = W / H``:

* the **condition image** for the text encoder: resized by the pipeline's ``image_processor.resize`` to
  ``calculate_dimensions(condition_area, r)`` (the pipeline's ``CONDITION_IMAGE_SIZE``, 384 x 384 pixels
  of area, sides rounded to 32); the instruction is encoded by the pipeline's own ``encode_prompt``
  with every condition image (the edit template, ``"Picture k: <|vision_start|><|image_pad|>
  <|vision_end|>"`` per source before the instruction, Qwen2.5-VL's processor and vision tower, the
  template's first 64 tokens dropped). The negative prompt is encoded with the same images. So the
  text conditioning depends on the sources (``text_reads_sources``): ``source_conditioning`` makes the
  whole conditioning of a batch with sources, and the text-embedding cache serves only text-only rows;
* the **VAE image**: ``image_processor.preprocess`` at ``calculate_dimensions(source_area, r)`` (the
  pipeline's ``VAE_IMAGE_SIZE``, 1024 x 1024), encoded by the VAE (the posterior's mode, ``(z -
  latents_mean) / latents_std``) and packed into 2x2-patch tokens.

The transformer runs on ``[generated tokens, source 1's tokens, source 2's, ...]`` with ``img_shapes``
``[(1, h/2, w/2), (1, h_1/2, w_1/2), ...]`` (each source its RoPE frame index), and the velocity is its
output over the generated tokens. The generated image has the policy's resolution (the pipeline's
``height`` / ``width``; its own default follows the last source's aspect ratio at 1024 x 1024).

Conditioning (batch-first): ``prompt_embeds`` / ``prompt_embeds_mask`` (and the ``negative_`` pair
with guidance) padded to ``max_sequence_length``, ``source_latents`` ``[B, N, 64]`` (each row's source
tokens in order, zero-padded to the batch's longest) and ``source_shapes`` ``[B, 3, 2]`` int64 on the
CPU (each source's packed grid, ``(0, 0)`` after the last). Rows may carry different numbers and
sizes of sources: ``velocity`` runs each set of rows with one source layout in its own transformer
call (one call when they agree), so a row's velocity does not depend on its batch-mates.
"""
from __future__ import annotations

from typing import Annotated, Sequence, Union

import torch

from .base import IMAGE_SIZE
from flowrl.options import AtLeast, Guidance
from flowrl.utils.images import to_pil

from .common import Resolution, Schedule, Shift, module_dtype, transformer_dtype
from .facts import ModelConfigs
from .qwen_family import (QWEN_IMAGE_20B, QWEN_IMAGE_VAE, QWEN_TEXT_ENCODERS, QwenFamilyPolicy, QwenTextTokens,
                          pack_latents, tiny_qwen_components)
from .tiny import build_qwen_tokenizer

CONDITION_AREA = 384 * 384  # the pipeline's CONDITION_IMAGE_SIZE: pixels of a source as the text encoder sees it
SOURCE_AREA = 1024 * 1024  # the pipeline's VAE_IMAGE_SIZE: pixels of a source as the VAE encodes it
Area = Annotated[int, AtLeast(32 * 32)]  # pixels of a source (at least 32 x 32)
MAX_SOURCES = 3  # Qwen-Image-Edit-2509 / 2511 are trained and documented with one to three images
# Qwen/Qwen-Image-Edit-2509 transformer/config.json is Qwen-Image's; Qwen/Qwen-Image-Edit-2511 adds zero_cond_t
# (its config.json's "zero_cond_t": true, read by diffusers >= the 2511 support, diffusers issue 12889); both use
# Qwen-Image's Qwen2.5-VL-7B text encoder and VAE
QWEN_IMAGE_EDIT_2511 = dict(QWEN_IMAGE_20B, zero_cond_t=True)
# the tiny processor's image sizes: 56 x 56 to 112 x 112 pixels (Qwen2.5-VL's: 3136 to 12845056), its patch and merge
TINY_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}


class QwenImageEditPolicy(QwenFamilyPolicy):
    """``FlowPolicy`` for Qwen-Image-Edit-2509 / 2511 (see module doc).

    Args:
        pipe: a loaded ``QwenImageEditPlusPipeline`` (its components are used, not its loop).
        guidance_scale: the pipeline's ``true_cfg_scale`` (default 4.0); 1.0 = off.
        negative_prompt: the unconditional prompt (encoded with each row's sources).
        max_sequence_length: text-encoder tokens per row after the template, the pictures' tokens
            included (padding width; a longer row is an error; at most 1024, the pipeline's limit).
        condition_area: pixels of a source for the text encoder (the pipeline's 384 x 384).
        source_area: pixels of a source for the VAE (the pipeline's 1024 x 1024; Flow-Factory trains
            with 384 x 384).
        shift, schedule, resolution, device: as ``QwenImagePolicy``'s.
    """

    kind = "qwen-image-edit"
    pipeline_class = "QwenImageEditPlusPipeline"
    tiny_kinds = ("qwen-image-edit", "qwen-image-edit-2511")
    example_hub_id = "Qwen/Qwen-Image-Edit-2509"
    max_sources = MAX_SOURCES  # source images per prompt (flowrl.conditions)
    text_reads_sources = True  # the text encoder sees the sources: source_conditioning encodes text and sources
    # no generation without a source: QwenImageEditPlusPipeline.__call__ sizes the result from the last source
    # (image.size) and has no text-only path; flowrl.conditions.check_sources refuses such prompts before loading
    needs_sources = True
    published = {
        example_hub_id: ModelConfigs(QWEN_IMAGE_20B, QWEN_TEXT_ENCODERS, QWEN_IMAGE_VAE, example_hub_id,
                                     "Qwen-Image-Edit-2509", "qwen-image-edit-arch"),
        "Qwen/Qwen-Image-Edit-2511": ModelConfigs(QWEN_IMAGE_EDIT_2511, QWEN_TEXT_ENCODERS, QWEN_IMAGE_VAE,
                                                  "Qwen/Qwen-Image-Edit-2511", "Qwen-Image-Edit-2511",
                                                  "qwen-image-edit-2511-arch")}

    def __init__(self, pipe, *, guidance_scale: Guidance = 4.0, negative_prompt: str = " ",
                 max_sequence_length: QwenTextTokens = 1024, condition_area: Area = CONDITION_AREA,
                 source_area: Area = SOURCE_AREA, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        self._setup_qwen(pipe, guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                         max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                         resolution=resolution, device=device, condition_area=condition_area, source_area=source_area)

    @classmethod
    def tiny_components(cls, kind: str = "qwen-image-edit", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``QwenImageEditPlusPipeline``: Qwen-Image's tiny components (``qwen_family.tiny_qwen_components``:
        a 2-layer Qwen2.5-VL whose 1-block vision tower has the real patch 14 and 2x2 merge), ``zero_cond_t``
        for ``qwen-image-edit-2511``, and a ``Qwen2VLProcessor`` (Qwen2.5-VL's image processor, between 56 x 56
        and 112 x 112 pixels, over ``build_qwen_tokenizer``)."""
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

        tok = build_qwen_tokenizer()
        parts = tiny_qwen_components(tok, seed, **({"zero_cond_t": True} if kind.endswith("2511") else {}))
        images = Qwen2VLImageProcessor(size=TINY_SIZE, patch_size=14, temporal_patch_size=2, merge_size=2)
        processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok,
                                     video_processor=Qwen2VLVideoProcessor(size=TINY_SIZE))
        return {**parts, "processor": processor}

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Qwen-Image's text entries plus one source at the result's size (what an editing batch holds at
        least): ``source_latents`` ``[rows, (h/2)(w/2), 4C]`` and ``source_shapes`` ``[rows, 3, 2]``."""
        cond = super().example_conditioning(configs, geometry, rows, device, dtype)
        c, h, w = geometry.latent_shape
        cond["source_latents"] = torch.empty(rows, (h // 2) * (w // 2), 4 * c, device=device, dtype=dtype)
        cond["source_shapes"] = torch.zeros(rows, MAX_SOURCES, 2, dtype=torch.long)  # [B, 3, 2], on the CPU
        cond["source_shapes"][:, 0] = torch.tensor([h // 2, w // 2])
        return cond

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Qwen-Image's inputs, with the rows' source tokens appended to the generated ones and their grids
        to ``img_shapes`` (module doc). Every row of one call has the same source layout."""
        kw = super().transformer_inputs(config, dtype, x, sigma, cond, **settings)
        shapes = cond.get("source_shapes")
        if shapes is None:
            return kw
        if bool((shapes != shapes[:1]).any()):
            raise ValueError("the rows of one transformer call must share their source layout; velocity groups "
                             "them (call velocity, not the transformer, on a mixed batch)")
        grids = [(a, b) for a, b in shapes[0].tolist() if a]  # packed (rows, cols) of each source, in order
        n = sum(a * b for a, b in grids)
        if n:
            src = cond["source_latents"][:, :n].to(x.device, dtype)  # [B, n, 4C]
            kw["hidden_states"] = torch.cat([kw["hidden_states"], src], 1)  # [B, (h/2)(w/2) + n, 4C]
            (_, gh, gw), = kw["img_shapes"][0]
            kw["img_shapes"] = [[(1, gh, gw), *[(1, a, b) for a, b in grids]]] * x.shape[0]
        return kw

    # --- conditioning ----------------------------------------------------------------------
    def _prepared(self, sources: Sequence[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
        """The pipeline's two views of a row's sources: condition images (PIL, for the text encoder) and
        VAE images ``[1, 3, 1, H', W']`` in [-1, 1] (module doc)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        conditions, vae_images = [], []
        for image in sources:
            pil = to_pil(image)  # the 8-bit RGB image the pipeline takes (exact for sources read from 8-bit files)
            ratio = pil.size[0] / pil.size[1]
            cw, ch = calculate_dimensions(self.condition_area, ratio)
            vw, vh = calculate_dimensions(self.source_area, ratio)
            conditions.append(self.pipe.image_processor.resize(pil, ch, cw))
            vae_images.append(self.pipe.image_processor.preprocess(pil, vh, vw).unsqueeze(2))  # [1, 3, 1, H', W']
        return conditions, vae_images

    def _source_tokens(self, vae_images: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """VAE images -> their packed tokens float32 ``[n, 4C]`` (in order) and each one's packed grid."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=self.device).view(1, cfg.z_dim, 1, 1, 1)  # [1, C, 1, 1, 1]
        std = torch.tensor(cfg.latents_std, device=self.device).view(1, cfg.z_dim, 1, 1, 1)  # [1, C, 1, 1, 1]
        tokens, grids = [], []
        for image in vae_images:
            z = self.vae.encode(image.to(self.device, module_dtype(self.vae))).latent_dist.mode().float()  # [1, C, 1, h, w]
            z = (z - mean) / std
            tokens.append(pack_latents(z[:, :, 0])[0])  # [(h/2)(w/2), 4C]
            grids.append((z.shape[-2] // 2, z.shape[-1] // 2))
        return (torch.cat(tokens) if tokens else torch.zeros(0, 4 * cfg.z_dim, device=self.device)), grids

    @torch.no_grad()
    def source_conditioning(self, texts: list[str], sources: Sequence[tuple]) -> dict[str, torch.Tensor]:
        """The whole conditioning of rows ``texts`` with their ``sources`` (one tuple of ``[3, H, W]`` per
        row, in order, ``()`` for none), each row as the pipeline encodes it (module doc)."""
        if len(texts) != len(sources):
            raise ValueError(f"{len(texts)} texts but {len(sources)} rows of sources")
        rows, tokens, grids = [], [], []
        for text, row_sources in zip(texts, sources):
            if len(row_sources) > MAX_SOURCES:
                raise ValueError(f"a prompt carries {len(row_sources)} source images; Qwen-Image-Edit takes 1 to "
                                 f"{MAX_SOURCES}")
            conditions, vae_images = self._prepared(row_sources)
            images = conditions or None
            row = self._padded(*self.pipe.encode_prompt([text], image=images, device=self.device))
            if self.uses_negative:
                neg = self._padded(*self.pipe.encode_prompt([self.negative_prompt], image=images, device=self.device))
                row.update({f"negative_{k}": v for k, v in neg.items()})
            rows.append(row)
            t, g = self._source_tokens(vae_images)
            tokens.append(t)
            grids.append(g)
        cond = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}  # [B, L, D], [B, L]
        width = max(1, max(len(t) for t in tokens))
        cond["source_latents"] = torch.stack([torch.cat([t, t.new_zeros(width - len(t), t.shape[1])])
                                              for t in tokens])  # [B, N, 4C]
        shapes = torch.zeros(len(rows), MAX_SOURCES, 2, dtype=torch.long)  # [B, 3, 2], on the CPU
        for i, g in enumerate(grids):
            if g:
                shapes[i, :len(g)] = torch.tensor(g)
        cond["source_shapes"] = shapes
        return cond

    # --- FlowPolicy ----------------------------------------------------------------------
    def velocity(self, latents: torch.Tensor, sigma, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 ``[B, C, h, w]``; with sources, each set of rows with one source
        layout in its own (guided) transformer call, the results in row order (module doc)."""
        if "source_shapes" not in cond or latents.shape[0] == 0:  # text only (or no rows): Qwen-Image's velocity
            return super().velocity(latents, sigma, {k: v for k, v in cond.items() if not k.startswith("source_")})
        x = latents.to(self.device)  # [B, C, h, w]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(x.shape[0])  # [B]
        layouts: dict[tuple, list[int]] = {}
        for i, row in enumerate(cond["source_shapes"].flatten(1).tolist()):
            layouts.setdefault(tuple(row), []).append(i)
        if len(layouts) == 1:
            return self._velocity_sources(x, sigma, cond)
        parts, order = [], []
        for rows in layouts.values():
            idx = torch.tensor(rows, dtype=torch.long)
            parts.append(self._velocity_sources(x[idx.to(x.device)], sigma[idx.to(x.device)],
                                                {k: v[idx.to(v.device)] for k, v in cond.items()}))
            order += rows
        back = torch.argsort(torch.tensor(order)).to(x.device)  # concatenated groups -> row order
        return torch.cat(parts)[back]  # [B, C, h, w]

    def _velocity_sources(self, x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """The guided velocity of rows sharing one source layout (``cond["source_shapes"]`` all equal)."""
        layout = cond["source_shapes"][:1]  # [1, 3, 2]
        config = getattr(self.transformer, "module", self.transformer).config  # also under a DDP wrapper

        def forward(xx, s, pe, mask, src):
            c = {"prompt_embeds": pe, "prompt_embeds_mask": mask, "source_latents": src,
                 "source_shapes": layout.expand(xx.shape[0], -1, -1)}
            kw = self.transformer_inputs(config, transformer_dtype(self.transformer), xx, s, c, **self.forward_settings())
            return self.transformer_output(self.transformer(**kw)[0], xx)  # [b, C, h, w]

        text = [cond["prompt_embeds"], cond["prompt_embeds_mask"], cond["source_latents"]]
        negative = [cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"], cond["source_latents"]] \
            if self.guidance_scale != 1.0 else []
        return self._guided(forward, x, sigma, text, negative)


__all__ = ["CONDITION_AREA", "QWEN_IMAGE_EDIT_2511", "QwenImageEditPolicy", "SOURCE_AREA"]
