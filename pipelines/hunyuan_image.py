"""HunyuanImage 2.1 (Tencent Hunyuan 2025, 17B) and HunyuanImage 2.1 Distilled as a ``FlowPolicy``, over diffusers
``HunyuanImagePipeline``.

**Model.** ``HunyuanImageTransformer2DModel`` is an MMDiT: 20 double-stream then 40 single-stream blocks, 28 heads of
128, 2-axis RoPE on the image tokens. It runs on the VAE's latents as they are (``AutoencoderKLHunyuanImage``: 64
channels, spatial factor 32, patch 1), so flowrl's latents are the pipeline's, ``[B, 64, H/32, W/32]``; ``decode`` is
``latents / scaling_factor`` and the VAE (no shift), as the pipeline decodes.

**Text.** Two encoders, as ``HunyuanImagePipeline.encode_prompt`` runs them: Qwen2.5-VL-7B on the prompt in the
pipeline's system template, the hidden state three from the end (``hidden_state_skip_layer`` 2) after the
template's 34 tokens, padded to ``max_sequence_length`` (the pipeline's ``tokenizer_max_length``, 1000; the adapter
sets the pipeline's attribute to it) with its mask; and ByT5 on the prompt's quoted text (``extract_glyph_text``:
``'...'``, ``"..."`` and the Chinese quotes become ``Text "...". ``), 128 tokens, zeros with an all-zero mask when
the prompt quotes nothing. The transformer puts each row's valid tokens of both first and masks the rest, so
``transformer_inputs`` may cut both sequences to the batch's longest valid rows (the padding the pipeline keeps
only costs compute).

**Time and guidance** (``HunyuanImagePipeline.__call__``). The time input is the scheduler's timestep ``1000
sigma``; the model predicts the velocity. Two published checkpoints:

* **HunyuanImage-2.1** (``guidance_embeds: false``): the pipeline guides with its ``guider`` component,
  ``AdaptiveProjectedMixGuidance``: classifier-free guidance ``u + 3.5 (c - u)`` against the empty prompt for the
  first steps, then adaptive projected guidance (APG, Sadat et al. 2024) from step 6 on (``ocr_guider``, for prompts
  that quote text, from a later step), with a momentum buffer carried across the steps of one trajectory. A
  ``FlowPolicy`` velocity is a function of ``(x, sigma, cond)`` alone, so that state cannot be reproduced: flowrl
  runs plain CFG at ``guidance_scale`` (3.5) on every step, which equals the pipeline for its first 6 steps (and for
  all of them with a guider whose ``adaptive_projected_guidance_start_step`` is at least the step count).
* **HunyuanImage-2.1-Distilled** (``guidance_embeds: true``, ``use_meanflow: true``): guidance-distilled, so the
  guidance it was distilled with enters as an **embedding** (``guidance_scale`` x 1000; the pipeline's
  ``distilled_guidance_scale``, 3.25) and one pass runs per step: no CFG in sampling, in the training forward or in
  the KL reference (the adapter-disabled policy embeds the same guidance), whatever ``guidance_scale`` is. It is also
  MeanFlow-distilled (Geng et al. 2025): the transformer takes a second time ``timestep_r``, the end of the interval
  whose mean velocity it predicts; the pipeline passes the next step's timestep (0 at the last). flowrl's velocity
  has no next step, so ``r`` is read off the pipeline's own ``meanflow_steps``-step schedule (:func:`meanflow_end`:
  one step of that schedule below sigma, exactly the pipeline's next timestep on its grid); with ``meanflow_steps``
  None, ``r = sigma`` (the instantaneous velocity). Sampled with as many steps as ``meanflow_steps`` (the published
  8), flowrl's loop is the pipeline's.

**Schedule.** The pipeline's: ``linspace(1, 0, T + 1)[:-1]`` through the scheduler (static shift: 5 for the base,
4 for the distilled model in Tencent's own code).
"""
from __future__ import annotations

import functools
from typing import Annotated, Optional, Union

import numpy as np
import torch

from flowrl.options import AtLeast, Guidance

from .base import IMAGE_SIZE, DiffusersPolicy, TransformerLoraExport
from .common import Resolution, Schedule, Shift, TextTokens, check_scheduler, resolve_resolution, scheduler_sigmas
from .facts import Component, ModelConfigs
from .mmdit import DoubleSingleStreamFacts
from .qwen_family import QWEN25_VL_7B, tiny_qwen25_vl

# No peer publishes LoRA targets for HunyuanImage 2.1: Flow-GRPO's FLUX.1 targets (the same double-stream MMDiT
# layout: both streams' attention projections and feed-forwards), plus the single-stream blocks' attention and MLP
# input (their fused output layer is named like the model's final projection, which stays untouched); the token
# refiner's attention layers match the same names
HUNYUAN_IMAGE_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
)
# Published configs, as diffusers' scripts/convert_hunyuan_image_to_diffusers.py writes the two repositories'
# transformer/config.json and vae/config.json (hunyuanimage2.1 and hunyuanimage2.1-distilled)
HUNYUAN_IMAGE_21 = dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128, num_layers=20,
                        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=(1, 1),
                        qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584, text_embed_2_dim=1472,
                        rope_theta=256.0, rope_axes_dim=(64, 64), use_meanflow=False)
HUNYUAN_IMAGE_21_DISTILLED = dict(HUNYUAN_IMAGE_21, guidance_embeds=True, use_meanflow=True)
HUNYUAN_IMAGE_VAE = dict(in_channels=3, out_channels=3, latent_channels=64,
                         block_out_channels=[128, 256, 512, 512, 1024, 1024], layers_per_block=2,
                         spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289,
                         downsample_match_channel=True, upsample_match_channel=True)
# text_encoder_2/config.json: the Glyph-ByT5 encoder (a T5EncoderModel on google/byt5-small: 12 layers 1472 wide, 6
# heads of 64, gated-GELU 3584, byte vocabulary 384; d_model = the transformer's text_embed_2_dim). The repository's
# own copy was not found; these are byt5-small's published config values
BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                  relative_attention_num_buckets=32, relative_attention_max_distance=128,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)
# text_encoder/config.json: Qwen/Qwen2.5-VL-7B-Instruct (qwen_family.QWEN25_VL_7B, as Qwen-Image's)
TEXT_ENCODERS = {"text_encoder": Component("transformers:Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B),
                 "text_encoder_2": Component("transformers:T5EncoderModel", BYT5_SMALL)}
# The schedulers' static shifts and the guider of the base model: Tencent's own inference code (shift 5, guidance
# 3.5, 50 steps for the base; shift 4, distilled guidance 3.25, 8 steps for the distilled model) and the guider
# diffusers' HunyuanImage-2.1 documentation prints (CFG 3.5, then APG 10 with momentum -0.5 and rescale 10 from step
# 6; the OCR guider starts APG at step 38 in Tencent's code)
SCHEDULER_SHIFT = {"hunyuan-image": 5.0, "hunyuan-image-distilled": 4.0}
GUIDER = dict(guidance_scale=3.5, adaptive_projected_guidance_scale=10.0, adaptive_projected_guidance_momentum=-0.5,
              adaptive_projected_guidance_rescale=10.0, adaptive_projected_guidance_start_step=5)
OCR_GUIDER_START_STEP = 38
MEANFLOW_STEPS = 8  # the distilled model's published step count
TINY_VAE_FACTOR = 8  # the tiny VAE downsamples 8x (the published one 32x), so the 32-48 px toy images have latents


def checkpoint_with_keywords(module, *args, **kwargs):
    """Gradient checkpointing of one block that also passes keyword arguments (non-reentrant
    ``torch.utils.checkpoint``): ``HunyuanImageTransformer2DModel`` calls its checkpointing function with
    ``attention_mask=`` and ``image_rotary_emb=``, which diffusers' default one (``*args`` only) refuses with a
    ``TypeError`` in diffusers 0.42.1."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)


@functools.lru_cache(maxsize=None)
def checkpointable_transformer_class() -> type:
    """``HunyuanImageTransformer2DModel`` whose ``enable_gradient_checkpointing()`` defaults to
    :func:`checkpoint_with_keywords` (what ``flowrl plan`` and the architecture benchmark build,
    :meth:`HunyuanImagePolicy.transformer_component`; the module attribute
    ``CheckpointableHunyuanImageTransformer2DModel``, built on first use). A loaded model is fixed in place by the
    adapter instead (its class name is what ``save_pretrained`` records)."""
    from diffusers import HunyuanImageTransformer2DModel

    class CheckpointableHunyuanImageTransformer2DModel(HunyuanImageTransformer2DModel):
        def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
            super().enable_gradient_checkpointing(gradient_checkpointing_func or checkpoint_with_keywords)

    # the model's own name in messages (flowrl plan's, e.g. "... declares no context-parallel plan")
    CheckpointableHunyuanImageTransformer2DModel.__name__ = HunyuanImageTransformer2DModel.__name__
    return CheckpointableHunyuanImageTransformer2DModel


def __getattr__(name: str):
    """``CheckpointableHunyuanImageTransformer2DModel`` (a ``Component`` class name), built on first use without
    importing diffusers when the adapter module loads."""
    if name == "CheckpointableHunyuanImageTransformer2DModel":
        return checkpointable_transformer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def meanflow_end(sigma: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """MeanFlow's second time ``r`` [B] for each ``sigma`` [B]: one step of the decreasing schedule ``grid``
    ``[T + 1]`` (from 1 to 0) below sigma, interpolated linearly in the step index. On the grid, ``sigma = grid[i]``
    gives exactly ``grid[i + 1]`` (the pipeline's next timestep / 1000); ``r`` is 0 past the last step."""
    g = grid.to(sigma.device, sigma.dtype)
    ext = torch.cat([g, g.new_zeros(1)])  # [T + 2]
    i = ((g[None, :] >= sigma[:, None]).sum(1) - 1).clamp(0, len(g) - 2)  # [B]: the last grid point >= sigma
    hi, lo, below = ext[i], ext[i + 1], ext[i + 2]  # [B] each
    frac = ((hi - sigma) / (hi - lo)).clamp(0, 1)  # [B]: 0 on the grid
    return lo - frac * (lo - below)  # [B]


class HunyuanImagePolicy(DoubleSingleStreamFacts, TransformerLoraExport, DiffusersPolicy):
    """``FlowPolicy`` for HunyuanImage 2.1 and its distilled model (see module doc).

    Args:
        pipe: a loaded ``HunyuanImagePipeline`` (its components are used, not its loop).
        guidance_scale: the base model's CFG scale of ``u + s (c - u)`` (the published guider's 3.5; 1.0 = none, one
            pass); for the distilled model the embedded guidance (its ``distilled_guidance_scale``, published 3.25).
        negative_prompt: the unconditional prompt of the base model's CFG (the pipeline's ``""``).
        max_sequence_length: Qwen2.5-VL tokens after the template (the pipeline's ``tokenizer_max_length``, 1000).
        meanflow_steps: the distilled (MeanFlow) model's second time is one step of the pipeline's schedule of this
            many steps below sigma (:func:`meanflow_end`; the published 8); None: ``r = sigma``. Unused by the base.
        shift: None (default) = the pipeline's schedule; a float replaces it by ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels (multiples of the VAE factor, 32), int or (H, W); None = ``flowrl.json``'s,
            else the pipeline's 2048.
        device: where the models and all returned tensors live.
    """

    kind = "hunyuan-image"
    pipeline_class = "HunyuanImagePipeline"
    transformer_class = "HunyuanImageTransformer2DModel"
    lora_target_modules = HUNYUAN_IMAGE_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder", "text_encoder_2")
    # the base model's layout (its guider: real CFG), then the guidance- and MeanFlow-distilled one
    tiny_kinds = ("hunyuan-image", "hunyuan-image-distilled")
    example_hub_id = "hunyuanvideo-community/HunyuanImage-2.1-Diffusers"
    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    published = {hub: ModelConfigs(transformer, TEXT_ENCODERS, Component("diffusers:AutoencoderKLHunyuanImage",
                                                                          HUNYUAN_IMAGE_VAE), hub, title,
                                   "hunyuan-image-arch")
                 for hub, title, transformer in (
                     ("hunyuanvideo-community/HunyuanImage-2.1-Diffusers", "HunyuanImage-2.1", HUNYUAN_IMAGE_21),
                     ("hunyuanvideo-community/HunyuanImage-2.1-Distilled-Diffusers", "HunyuanImage-2.1-Distilled",
                      HUNYUAN_IMAGE_21_DISTILLED))}

    def __init__(self, pipe, *, guidance_scale: Guidance = 3.5, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 1000,
                 meanflow_steps: Optional[Annotated[int, AtLeast(1)]] = MEANFLOW_STEPS, shift: Shift = None,
                 schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                           meanflow_steps=meanflow_steps)
        check_scheduler("HunyuanImagePolicy", pipe.scheduler.config, shift, schedule)
        if pipe.scheduler.config.get("use_dynamic_shifting") and shift is None:
            raise ValueError("HunyuanImagePolicy: the scheduler shifts dynamically, which HunyuanImagePipeline cannot "
                             "run (it passes no mu); use a static-shift scheduler or pass shift=")
        self._setup(pipe, device)  # frozen VAE / text encoders, vae_scale_factor, LoRA targets, negative cache
        if self.transformer.gradient_checkpointing:  # from_pretrained's: diffusers' default function fails here
            self.transformer.enable_gradient_checkpointing(checkpoint_with_keywords)
        pipe.tokenizer_max_length = self.max_sequence_length  # what the pipeline's encode_prompt pads Qwen's text to
        config = self.transformer.config
        self.guidance_embeds = bool(config.guidance_embeds)
        self.meanflow = bool(config.get("use_meanflow", False))
        f = self.vae_scale_factor  # spatial_compression_ratio
        self.height, self.width = resolve_resolution(resolution, int(pipe.default_sample_size) * f, f)
        self.latent_shape = (int(config.in_channels), self.height // f, self.width // f)
        self._meanflow_grid: Optional[torch.Tensor] = None  # [meanflow_steps + 1], built on first use

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        return int(configs.vae.config["spatial_compression_ratio"])

    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        return int(transformer["patch_size"][0])

    @classmethod
    def default_resolution(cls, configs: ModelConfigs) -> int:
        return 2048  # HunyuanImagePipeline's default_sample_size 64 x the VAE's 32

    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """The published transformer as ``flowrl plan`` and the architecture benchmark build it, its gradient
        checkpointing working (:func:`checkpointable_transformer_class`)."""
        return Component(f"{__name__}:CheckpointableHunyuanImageTransformer2DModel", transformer)

    @classmethod
    def cfg_rows(cls, guidance_scale: float, options: dict) -> int:
        """Rows per sample of a sampling forward: 2 with the base model's CFG. (The planner reads the published
        base model's; a distilled model's one pass per row is below that.)"""
        return 2 if guidance_scale > 1.0 else 1

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL features ``[rows, L, text_embed_dim]``, ByT5 features ``[rows, 128, text_embed_2_dim]``
        and their int64 masks."""
        c = configs.transformer
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, c["text_embed_dim"], device=device,
                                             dtype=dtype),  # [B, L, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.int64),
                "prompt_embeds_2": torch.empty(rows, 128, c["text_embed_2_dim"], device=device, dtype=dtype),
                "prompt_embeds_mask_2": torch.empty(rows, 128, device=device, dtype=torch.int64)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, guidance_scale: float = 3.5,
                           meanflow_grid: Optional[torch.Tensor] = None, **settings) -> dict:
        """Latents ``[B, 64, h, w]`` as they are, time ``1000 sigma`` in the model's dtype, both texts cut to the
        batch's longest valid rows with their masks, the embedded guidance ``1000 guidance_scale`` of a
        guidance-distilled model and the MeanFlow end time ``1000 r`` (:func:`meanflow_end` on ``meanflow_grid``;
        ``r = sigma`` without one) of a MeanFlow model. Meta tensors (the planner's shapes) keep every token, the
        ByT5 ones appended to the Qwen sequence: the transformer's reordering of the two indexes by the masks'
        values, which meta tensors do not have (the same tokens enter the blocks)."""
        b = x.shape[0]
        pe, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]  # [B, L, D], [B, L]
        pe2, mask2 = cond["prompt_embeds_2"], cond["prompt_embeds_mask_2"]  # [B, 128, D2], [B, 128]
        if mask.device.type == "meta":
            pe = torch.cat([pe, pe.new_empty(b, pe2.shape[1], pe.shape[2])], dim=1)  # [B, L + 128, D]
            kw = dict(encoder_hidden_states=pe.to(dtype), encoder_attention_mask=torch.cat([mask, mask2], dim=1))
        else:
            n, n2 = max(int(mask.sum(1).max()), 1), max(int(mask2.sum(1).max()), 1)
            kw = dict(encoder_hidden_states=pe[:, :n].to(x.device, dtype),
                      encoder_attention_mask=mask[:, :n].to(x.device),
                      encoder_hidden_states_2=pe2[:, :n2].to(x.device, dtype),
                      encoder_attention_mask_2=mask2[:, :n2].to(x.device))
        kw.update(hidden_states=x.to(dtype), timestep=(sigma * 1000.0).to(dtype), return_dict=False)
        if config.get("guidance_embeds"):
            kw["guidance"] = torch.full((b,), guidance_scale, dtype=dtype, device=x.device) * 1000.0  # [B]
        if config.get("use_meanflow"):
            r = sigma if meanflow_grid is None or sigma.device.type == "meta" else meanflow_end(sigma, meanflow_grid)
            kw["timestep_r"] = (r * 1000.0).to(dtype)  # [B]
        return kw

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1,
                "num_single_layers": 1, "num_refiner_layers": 1, "text_embed_dim": 16, "text_embed_2_dim": 16,
                "rope_axes_dim": (4, 4)}

    @classmethod
    def tiny_components(cls, kind: str = "hunyuan-image", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``HunyuanImagePipeline``: the published transformer of ``kind`` shrunk (:meth:`shrink_config`: 1 + 1
        blocks, 2 heads of 8, one refiner block, 64 latent channels, patch 1; ``"hunyuan-image-distilled"`` with the
        guidance embedding and MeanFlow's second time), an ``AutoencoderKLHunyuanImage`` with 64 latent channels but
        factor 8 (:data:`TINY_VAE_FACTOR`), a 3-layer ``Qwen2_5_VLForConditionalGeneration`` 16 wide (the pipeline
        reads the third hidden state from the end) over ``build_qwen_tokenizer`` (the template's 34 tokens, as with
        Qwen's), a 2-layer ``T5EncoderModel`` 16 wide over the byte-level ``ByT5Tokenizer``, the published
        scheduler shift of ``kind``, and for the base model its published guider (CFG, APG from step 6) and an OCR
        guider starting APG at step 38."""
        from diffusers import (AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler,
                               HunyuanImageTransformer2DModel)
        from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

        from .tiny import build_qwen_tokenizer

        tok = build_qwen_tokenizer()
        text_encoder = tiny_qwen25_vl(tok, num_layers=3, seed=seed)
        tok2 = ByT5Tokenizer()
        torch.manual_seed(seed + 1)
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tok2), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
            is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)).eval()
        published = HUNYUAN_IMAGE_21_DISTILLED if kind == "hunyuan-image-distilled" else HUNYUAN_IMAGE_21
        torch.manual_seed(seed + 2)
        transformer = HunyuanImageTransformer2DModel(**cls.shrink_config(published))
        torch.manual_seed(seed + 3)
        vae = AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=64,
                                        block_out_channels=(32, 32, 32, 128), layers_per_block=1,
                                        spatial_compression_ratio=TINY_VAE_FACTOR, sample_size=image_size,
                                        scaling_factor=HUNYUAN_IMAGE_VAE["scaling_factor"])
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT[kind],
                                                    use_dynamic_shifting=False)
        guiders = dict(guider=None, ocr_guider=None)
        if kind == "hunyuan-image":
            guiders = dict(guider=AdaptiveProjectedMixGuidance(**GUIDER),
                           ocr_guider=AdaptiveProjectedMixGuidance(
                               **{**GUIDER, "adaptive_projected_guidance_start_step": OCR_GUIDER_START_STEP}))
        return dict(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder, tokenizer=tok,
                    text_encoder_2=text_encoder_2, tokenizer_2=tok2, **guiders)

    # --- FlowPolicy ----------------------------------------------------------------------
    @property
    def cfg_scale(self) -> float:
        """Real CFG scale: 1.0 for a guidance-distilled model (its guidance is embedded)."""
        return 1.0 if self.guidance_embeds else self.guidance_scale

    def forward_settings(self) -> dict:
        if self.meanflow and self.meanflow_steps is not None and self._meanflow_grid is None:
            self._meanflow_grid = self.sigmas(int(self.meanflow_steps))  # [meanflow_steps + 1]
        return {"guidance_scale": self.guidance_scale, "meanflow_grid": self._meanflow_grid}

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, mask, pe2, mask2 = self.pipe.encode_prompt(list(prompts), self.device, batch_size=len(prompts))
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask.long(), "prompt_embeds_2": pe2,
                "prompt_embeds_mask_2": mask2.long()}

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: Qwen2.5-VL ``prompt_embeds`` [B, max_sequence_length, D] with
        ``prompt_embeds_mask`` [B, max_sequence_length], ByT5 ``prompt_embeds_2`` [B, 128, D2] with
        ``prompt_embeds_mask_2`` [B, 128]; with the base model's CFG also the cached ``negative_*`` of each."""
        return super().encode_prompts(prompts)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas ``HunyuanImagePipeline`` gives its scheduler: ``linspace(1, 0, T + 1)[:-1]``."""
        return scheduler_sigmas(self.pipe.scheduler, np.linspace(1.0, 0.0, num_steps + 1)[:-1])


__all__ = ["BYT5_SMALL", "HUNYUAN_IMAGE_21", "HUNYUAN_IMAGE_21_DISTILLED", "HUNYUAN_IMAGE_LORA_TARGET_MODULES",
           "HUNYUAN_IMAGE_VAE", "HunyuanImagePolicy", "meanflow_end"]
