"""Z-Image and Z-Image-Turbo (Tongyi-MAI 2025, 6B) as a ``FlowPolicy``, over diffusers ``ZImagePipeline`` components.

**Model.** ``ZImageTransformer2DModel`` is a single-stream DiT (S3-DiT): noise-refiner blocks on the
image tokens, context-refiner blocks on the caption, then the main blocks on the joint sequence. It
takes *lists*: one ``[C, 1, h, w]`` latent (a frame axis of 1) and one caption ``[n_i, D]`` of its own
length per sample, and returns a list; flowrl's latents are the VAE's ``[B, 16, H/8, W/8]`` (FLUX.1's
``AutoencoderKL``, decoded with its scaling / shift factors), and ``transformer_inputs`` /
``transformer_output`` convert.

**Conventions** (``ZImagePipeline.__call__``). Z-Image's own time runs from noise (0) to data (1): the
time input is ``(1000 - t) / 1000`` with ``t = 1000 sigma``, and the model predicts ``x0 - noise``, so the
velocity is the negated output. The pipeline's guidance is ``pos + g (pos - neg)`` against
``negative_prompt`` (its default ``""``), on when its ``guidance_scale`` g > 0; flowrl's ``guidance_scale``
is the usual CFG scale s of ``u + s (c - u)`` (1.0 = none, as for every model), so **s = g + 1**: the
pipeline's default g = 5.0 is s = 6.0, Z-Image-Turbo's g = 0 is s = 1.0 (one doubled batch, as the
pipeline runs it). The pipeline's optional ``cfg_normalization`` and ``cfg_truncation`` are off by
default and not reproduced.

**Text.** The pipeline's own ``encode_prompt``: Qwen3 chat template (thinking on: no empty thinking
block), the text encoder's second-to-last hidden state, each prompt's own tokens only (its attention
mask). flowrl pads them to ``max_sequence_length`` with an int64 mask (batch-first conditioning of one
width); ``transformer_inputs`` cuts each row back to its own tokens.

**Schedule.** The pipeline's: ``linspace(1, 1/T, T)`` through the scheduler. Both published
schedulers are static (``use_dynamic_shifting: false``): shift 6.0 for Z-Image, 3.0 for Z-Image-Turbo,
the step-distilled model, which samples in **8 steps without guidance** (the pipeline's
``guidance_scale=0``, flowrl's 1.0: its published setting, the diffusers example's). Its recipe trains
those 8 steps; each of them covers a large sigma interval, so an SDE window of a few steps puts the
exploration noise, and the trained log-probabilities, on transitions much coarser than a 20-50 step
model's (docs/models.md, "Few-step distilled models").
"""
from __future__ import annotations

from typing import Union

import torch

from flowrl.options import Guidance

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, Schedule, Shift, TextTokens, check_scheduler, scheduler_sigmas
from .components import FLUX_VAE, QWEN3_4B
from .facts import Component, ModelConfigs

# Flow-Factory's default LoRA targets for Z-Image (src/flow_factory/models/z_image/z_image.py; r=64, alpha=128):
# every block's attention projections and SwiGLU feed-forward (noise refiner, context refiner and main blocks)
Z_IMAGE_LORA_TARGET_MODULES = ("attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
                               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
# Published configs (the repositories' */config.json). Tongyi-MAI/Z-Image and Z-Image-Turbo transformer/config.json
# (ZImageTransformer2DModel, diffusers' defaults for it): 30 main + 2 noise-refiner + 2 context-refiner blocks, 3840
# wide, 30 heads, captions of 2560 (Qwen3-4B), patch 2, 3-axis RoPE (32, 48, 48); text_encoder/config.json is
# Qwen3-4B as a Qwen3Model and vae/config.json FLUX.1's AutoencoderKL (both in pipelines/components.py); the
# schedulers: static shift 6.0 (Z-Image) and 3.0 (Z-Image-Turbo)
Z_IMAGE_6B = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                  n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                  rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512))
SCHEDULER_SHIFT = {"z-image": 6.0, "z-image-turbo": 3.0}  # tiny kind -> its published scheduler's static shift


def _published(hub_id: str, title: str) -> ModelConfigs:
    return ModelConfigs(Z_IMAGE_6B, {"text_encoder": Component("transformers:Qwen3Model", QWEN3_4B)},
                        Component("diffusers:AutoencoderKL", FLUX_VAE), hub_id, title, "z-image-arch")


class ZImagePolicy(DiffusersPolicy):
    """``FlowPolicy`` for Z-Image / Z-Image-Turbo (see module doc).

    Args:
        pipe: a loaded ``ZImagePipeline`` (its components are used, not its loop).
        guidance_scale: the CFG scale s of ``u + s (c - u)``, 1.0 = none (one pass; Z-Image-Turbo's setting);
            the pipeline's ``guidance_scale`` is s - 1 (its default 5.0 is s = 6.0, the default here).
        negative_prompt: the unconditional prompt (the pipeline's default ``""``).
        max_sequence_length: text tokens at most (the pipeline's default 512).
        shift: None (default) = the pipeline's schedule; a float replaces it by ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels, int or (H, W); None = ``flowrl.json``'s, else the pipeline's 1024.
        device: where the models and all returned tensors live.
    """

    kind = "z-image"
    pipeline_class = "ZImagePipeline"
    transformer_class = "ZImageTransformer2DModel"
    lora_target_modules = Z_IMAGE_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    tiny_kinds = ("z-image", "z-image-turbo")
    example_hub_id = "Tongyi-MAI/Z-Image-Turbo"
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")  # _forward(x, sigma, *these) (base velocity)
    published = {m.source: m for m in (_published("Tongyi-MAI/Z-Image", "Z-Image"),
                                       _published(example_hub_id, "Z-Image-Turbo"))}

    def __init__(self, pipe, *, guidance_scale: Guidance = 6.0, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 512, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        # guidance_scale >= 1.0: 1.0 = no guidance (the pipeline's guidance_scale g is flowrl's g + 1)
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule)
        check_scheduler("ZImagePolicy", pipe.scheduler.config, shift, schedule)
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor, LoRA targets, negative cache
        self._image_geometry(resolution, 1024, self.transformer.config.in_channels)  # the pipeline's default 1024 px

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        return int(transformer["all_patch_size"][0])

    @classmethod
    def default_resolution(cls, configs: ModelConfigs) -> int:
        return 1024  # ZImagePipeline's default height / width

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Qwen3 hidden states ``[rows, L, cap_feat_dim]`` and their int64 mask ``[rows, L]``."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["cap_feat_dim"],
                                             device=device, dtype=dtype),  # [B, L, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.int64)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Latents ``[B, C, h, w]`` as a list of ``[C, 1, h, w]``, each caption cut to its own tokens (its
        mask; meta tensors, the planner's shapes, keep all of them), time ``(1000 - 1000 sigma) / 1000``."""
        b, _, h, w = x.shape
        p = int(config["all_patch_size"][0])
        if h % p or w % p:
            raise ValueError(f"Z-Image latents need height and width divisible by the patch {p}, got {tuple(x.shape)}")
        pe, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]  # [B, L, D], [B, L]
        lengths = [pe.shape[1]] * b if mask.device.type == "meta" else mask.sum(1).tolist()
        caps = [pe[i, :n].to(x.device, dtype) for i, n in enumerate(lengths)]  # [n_i, D] each
        t = sigma * 1000.0
        return dict(x=list(x.to(dtype).unsqueeze(2).unbind(0)), t=(1000.0 - t) / 1000.0, cap_feats=caps,
                    return_dict=False)  # x: [C, 1, h, w] per sample

    @classmethod
    def transformer_output(cls, out, x: torch.Tensor) -> torch.Tensor:
        """The list of ``[C, 1, h, w]`` predictions (of ``x0 - noise``) as the velocity ``[B, C, h, w]``."""
        return -torch.stack(list(out)).squeeze(2)  # [B, C, h, w]

    @classmethod
    def block_counts(cls, transformer: dict) -> dict[str, int]:
        """Refiner blocks (``n_refiner_layers`` each for the image and the caption), then the main blocks."""
        return {"refiner": int(transformer["n_refiner_layers"]), "main": int(transformer["n_layers"])}

    @classmethod
    def with_block_counts(cls, transformer: dict, counts: dict[str, int]) -> dict:
        return {**transformer, "n_refiner_layers": counts["refiner"], "n_layers": counts["main"]}

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                "cap_feat_dim": 16, "axes_dims": (8, 4, 4), "axes_lens": (256, 32, 32)}

    @classmethod
    def tiny_components(cls, kind: str = "z-image", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``ZImagePipeline``: a ``ZImageTransformer2DModel`` of 2 main + 1 + 1 refiner blocks 32 wide
        (patch 2, 16 latent channels, captions of 16; sizes as diffusers' Z-Image fast tests), a 2-layer
        ``Qwen3Model`` 16 wide over ``build_qwen_tokenizer(qwen3=True)``, FLUX.1's VAE layout at width 8,
        and the published scheduler of ``kind``: static shift 6.0 (``"z-image"``) or 3.0 (``"z-image-turbo"``)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

        from .tiny import build_qwen_tokenizer, kl_vae, qwen3_encoder

        tok = build_qwen_tokenizer(qwen3=True)
        torch.manual_seed(seed)
        text_encoder = qwen3_encoder("Qwen3Model", tok, 2)
        torch.manual_seed(seed + 1)
        transformer = ZImageTransformer2DModel(**cls.shrink_config(Z_IMAGE_6B))
        torch.manual_seed(seed + 2)
        vae = kl_vae(FLUX_VAE["scaling_factor"], FLUX_VAE["shift_factor"], image_size)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT[kind],
                                                    use_dynamic_shifting=False)
        return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)  # [n_i, D] each
        d, n = embeds[0].shape[-1], self.max_sequence_length
        pe = torch.zeros(len(embeds), n, d, dtype=embeds[0].dtype, device=embeds[0].device)  # [B, L, D]
        mask = torch.zeros(len(embeds), n, dtype=torch.long, device=pe.device)  # [B, L]
        for i, e in enumerate(embeds):
            pe[i, :len(e)], mask[i, :len(e)] = e, 1
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask}

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: Qwen3 ``prompt_embeds`` [B, max_sequence_length, D] (each prompt's tokens,
        zero padded) and ``prompt_embeds_mask`` [B, max_sequence_length]; with guidance also the cached
        ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``."""
        return super().encode_prompts(prompts)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas ``ZImagePipeline`` gives its scheduler (module doc)."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

        cfg = self.pipe.scheduler.config
        mu = calculate_shift(self.image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))  # ignored by a static scheduler
        return scheduler_sigmas(self.pipe.scheduler, get_default_z_image_sigmas(num_steps), mu)


__all__ = ["Z_IMAGE_6B", "Z_IMAGE_LORA_TARGET_MODULES", "ZImagePolicy"]
