"""Wan2.1 text-to-video (Wan Team 2025) as a ``FlowPolicy``, over diffusers ``WanPipeline`` components.

Latents are the causal video VAE's (``AutoencoderKLWan``) ``[B, 16, F', H/8, W/8]`` with ``F' = (F - 1)
/ 4 + 1`` latent frames for ``F = num_frames`` video frames (``F = 4k + 1``, as Wan requires);
the 3D DiT (``WanTransformer3DModel``, patch ``(1, 2, 2)``) is the trainable part, the UMT5 text
encoder and the VAE are frozen. Wan is a rectified flow with the SD3 velocity convention
(``x_sigma = (1 - sigma) x0 + sigma noise``, prediction ``noise - x0``); its time input is
``timestep = sigma * 1000`` (the pipeline passes ``scheduler.timesteps``).

Prompts are encoded by the pipeline's own ``encode_prompt`` (UMT5 last hidden state, zero past
each prompt's length, ``max_sequence_length`` tokens); the transformer gets no mask, as in the
pipeline. Guidance is classifier-free against ``negative_prompt`` (one doubled batch, uncond
first; the pipeline runs two passes). ``decode`` returns float32 **videos** ``[B, 3, F, H, W]`` in
[0, 1]: ``z * latents_std + latents_mean`` per channel, VAE decode, ``x / 2 + 0.5``.

Sampling: flowrl's step functions on ``flow_sigmas(T, shift)`` with the scheduler's shift
(``shift`` of a flow-matching Euler scheduler, which makes the schedule exactly the pipeline's;
``flow_shift`` of Wan2.1's shipped UniPC multistep scheduler, whose own solver steps a similarly
shifted schedule). Wan2.2's two-expert pipelines (``transformer_2``, ``boundary_ratio``) and its
per-token timesteps (``expand_timesteps``) are refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import torch

from flowrl.schedules import flow_sigmas

from .base import FLOWRL_JSON, IMAGE_SIZE, DiffusersPolicy, Resolution, read_flowrl_json, resolve_resolution
from .common import DECODE_BATCH, DTypeArg, module_dtype, transformer_dtype

# Flow-GRPO's LoRA targets for Wan2.1 (scripts/train_wan2_1.py: r=32, alpha=64, gaussian init) are
# to_q / to_k / to_v / to_out.0 plus add_k_proj / add_q_proj / add_v_proj / to_add_out; as peft suffix
# patterns the first four match self-attention (attn1) and cross-attention (attn2) of every block; the
# add_* projections exist only in the image-to-video model (added_kv_proj_dim), so text-to-video leaves
# them out.
WAN_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
DEFAULT_NUM_FRAMES = 81  # WanPipeline's default
TINY_NUM_FRAMES = 5  # two latent frames: the tiny model's default (flowrl.json)


def video_vae_decode(vae, latents: torch.Tensor, device, batch: Optional[int] = DECODE_BATCH) -> torch.Tensor:
    """Latents ``[B, C, F', h, w]`` -> float32 videos ``[B, 3, F, f h, f w]`` in [0, 1] through a
    Wan-style causal video VAE (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``), as the Wan and
    Qwen-Image pipelines decode: ``latents / (1 / latents_std) + latents_mean`` per channel, VAE
    decode (``[-1, 1]``), ``x / 2 + 0.5`` clamped. ``batch`` videos per VAE call (None: all)."""
    cfg = vae.config
    dtype = module_dtype(vae)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)  # [1, C, 1, 1, 1]
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)  # [1, C, 1, 1, 1]
    step = batch or max(1, len(latents))
    out = []
    for i in range(0, len(latents), step):
        z = latents[i:i + step].to(device, dtype) / inv_std + mean  # [b, C, F', h, w]
        with torch.no_grad():
            video = vae.decode(z, return_dict=False)[0]  # [b, 3, F, H, W] in [-1, 1]
        out.append((video.float() / 2 + 0.5).clamp(0, 1))
    return torch.cat(out)  # [B, 3, F, H, W]


def _add_to_flowrl_json(path: Union[str, os.PathLike], **entries) -> None:
    """Merge ``entries`` into ``path/flowrl.json`` (written whole to a sibling, then renamed)."""
    p = Path(path) / FLOWRL_JSON
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**read_flowrl_json(path), **entries}, indent=2))
    os.replace(tmp, p)


class WanPolicy(DiffusersPolicy):
    """``FlowPolicy`` for Wan2.1 text-to-video (see module doc).

    Args:
        pipe: a loaded ``WanPipeline`` (its components are used, not its loop).
        guidance_scale: CFG scale; 1.0 = no guidance (single pass). The pipeline's default is 5.0.
        negative_prompt: the unconditional prompt (the pipeline's default ``""``).
        max_sequence_length: UMT5 tokens (the pipeline's default 512).
        num_frames: video frames ``F``, ``4k + 1``; None = ``flowrl.json``'s, else the pipeline's 81.
        shift: the flow shift; None takes the scheduler's ``shift`` (flow-matching Euler) or ``flow_shift`` (UniPC).
        schedule: ``"diffusers"`` or ``"linear"`` (``flowrl.schedules.flow_sigmas``).
        resolution: frame size in pixels, int or (H, W); None = ``flowrl.json``'s, else the
            pipeline's default (480, 832).
        device: where the models and all returned tensors live.
    """

    kind = "wan"
    pipeline_class = "WanPipeline"
    transformer_class = "WanTransformer3DModel"
    lora_target_modules = WAN_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    tiny_kinds = ("wan",)
    example_hub_id = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"

    def __init__(self, pipe, *, guidance_scale: float = 5.0, negative_prompt: str = "",
                 max_sequence_length: int = 512, num_frames: Optional[int] = None, shift: Optional[float] = None,
                 schedule: str = "diffusers", resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0 (1.0 = no guidance), got {guidance_scale}")
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("expand_timesteps"):
            raise ValueError("this is a Wan2.2 pipeline (two experts or per-token timesteps); WanPolicy covers "
                             "Wan2.1 text-to-video (one transformer)")
        num_frames = DEFAULT_NUM_FRAMES if num_frames is None else num_frames
        ft = int(pipe.vae_scale_factor_temporal)
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for Wan's video VAE, got {num_frames!r}")
        sched = pipe.scheduler.config
        if shift is None:
            shift = (sched.get("flow_shift") if sched.get("use_flow_sigmas") else sched.get("shift")) or 1.0
        flow_sigmas(1, float(shift), schedule)  # validates shift and schedule early
        pipe.vae_scale_factor = pipe.vae_scale_factor_spatial  # the name the base's _setup reads
        self._setup(pipe, device)  # frozen VAE / text encoder, LoRA targets, negative cache
        self.guidance_scale = float(guidance_scale)
        self.negative_prompt = str(negative_prompt)
        self.max_sequence_length = int(max_sequence_length)
        self.num_frames = num_frames
        self.shift, self.schedule = float(shift), schedule
        cfg = self.transformer.config
        f, (_, ph, pw) = self.vae_scale_factor, cfg.patch_size
        if ph != pw:
            raise ValueError(f"WanPolicy expects a square spatial patch, got patch_size={tuple(cfg.patch_size)}")
        self.height, self.width = resolve_resolution(resolution, (480, 832), f * ph)
        self.latent_shape = (int(cfg.in_channels), (num_frames - 1) // ft + 1, self.height // f,
                             self.width // f)  # (C, F', h, w)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def tiny_components(cls, kind: str = "wan", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``WanPipeline``: a 2-layer ``WanTransformer3DModel`` (patch (1, 2, 2), 16 latent
        channels, cross-attention norm, RMS qk-norm across heads; sizes as diffusers' Wan fast
        tests), an ``AutoencoderKLWan`` with Wan's layout (16 latent channels, spatial factor 8,
        temporal factor 4, its latent mean / std) at width 8, a 2-layer ``UMT5EncoderModel`` over the
        offline T5 tokenizer (``pipelines/tiny.py``), and a flow-matching Euler scheduler with
        Wan2.1's 480p flow shift 3."""
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        from .tiny import build_t5_tokenizer

        tok = build_t5_tokenizer(model_max_length=512)
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, is_encoder_decoder=False))
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])  # default latents_mean / std
        torch.manual_seed(seed + 2)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer,
                    transformer_2=None)

    @classmethod
    def make_tiny(cls, kind: str, out_dir: Union[str, os.PathLike], *, image_size: int = IMAGE_SIZE, seed: int = 0,
                  overwrite: bool = False) -> Path:
        """The base's tiny model, with ``num_frames`` = ``TINY_NUM_FRAMES`` recorded in ``flowrl.json``."""
        out = super().make_tiny(kind, out_dir, image_size=image_size, seed=seed, overwrite=overwrite)
        _add_to_flowrl_json(out, num_frames=TINY_NUM_FRAMES)
        return out

    @classmethod
    def from_pretrained(cls, path_or_id: Union[str, os.PathLike], *, dtype: DTypeArg = torch.float32, **kwargs):
        """``DiffusersPolicy.from_pretrained``; ``num_frames`` None takes ``flowrl.json``'s (then 81)."""
        if kwargs.get("num_frames") is None and path_or_id:
            kwargs["num_frames"] = read_flowrl_json(path_or_id).get("num_frames")
        return super().from_pretrained(path_or_id, dtype=dtype, **kwargs)

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """The base's save, with ``num_frames`` in ``flowrl.json`` (the default when loaded back)."""
        super().save_pretrained(path)
        _add_to_flowrl_json(path, num_frames=self.num_frames)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                        max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": pe}  # [B, L, D], zero past each prompt's tokens

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: UMT5 ``prompt_embeds`` [B, max_sequence_length, D]; with guidance
        also the cached ``negative_prompt_embeds``."""
        return super().encode_prompts(prompts)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        dtype = transformer_dtype(self.transformer)
        return self.transformer(hidden_states=x.to(dtype), timestep=sigma * 1000.0,  # [B, C, F', h, w]
                                encoder_hidden_states=pe.to(self.device, dtype), return_dict=False)[0]

    cond_keys = ("prompt_embeds",)  # _forward(x, sigma, *these) (base velocity, on [B, C, F', h, w])

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]`` float32 from 1 to 0: ``flow_sigmas(num_steps, shift, schedule)``."""
        return flow_sigmas(num_steps, self.shift, self.schedule)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F', h, w]`` -> float32 videos ``[B, 3, F, 8h, 8w]`` in [0, 1] (module doc)."""
        return video_vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, F, H, W]


__all__ = ["DEFAULT_NUM_FRAMES", "TINY_NUM_FRAMES", "WAN_LORA_TARGET_MODULES", "WanPolicy", "video_vae_decode"]
