"""What the Wan adapters share (Wan2.1 ``wan``: :mod:`flowrl.pipelines.wan`; Wan2.2 ``wan2.2``:
:mod:`flowrl.pipelines.wan22`): Wan text-to-video (Wan Team 2025) as a ``FlowPolicy``, over diffusers
``WanPipeline`` components.

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
shifted schedule).

Wan2.2 (``flowrl.pipelines.wan22.Wan22Policy``, ``model.pipeline: wan2.2``): T2V-A14B's two experts switched
at ``boundary_ratio`` (one module, ``flowrl.pipelines.experts.TwoExperts``) with ``guidance_scale_2``; TI2V-5B's
one expert with its own VAE (48 channels, 16x spatial) and per-token timesteps (``expand_timesteps``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar, Optional, Union

import torch

from flowrl.options import Guidance, PositiveInt

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, Schedule, Shift, TextTokens, resolve_resolution
from .components import WAN21_VAE
from .experts import check_second_expert, experts_component
from .facts import Component, Geometry, ModelConfigs
from .video import video_vae_decode

# Flow-GRPO's LoRA targets for Wan2.1 (scripts/train_wan2_1.py: r=32, alpha=64, gaussian init) are
# to_q / to_k / to_v / to_out.0 plus add_k_proj / add_q_proj / add_v_proj / to_add_out; as peft suffix
# patterns the first four match self-attention (attn1) and cross-attention (attn2) of every block; the
# add_* projections exist only in the image-to-video model (added_kv_proj_dim), so text-to-video leaves
# them out.
WAN_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
DEFAULT_NUM_FRAMES = 81  # WanPipeline's default
DEFAULT_RESOLUTION = (480, 832)  # WanPipeline's default (H, W)
TINY_NUM_FRAMES = 5  # two latent frames: the tiny model's default (flowrl.json)

# Published configs of Wan-AI/Wan2.1-T2V-1.3B-Diffusers and Wan-AI/Wan2.1-T2V-14B-Diffusers (their */config.json;
# flowrl plan and bench precision build the models from them, no download). transformer/config.json
# (WanTransformer3DModel) as diffusers' scripts/convert_wan_to_diffusers.py writes it for "Wan-T2V-1.3B" (30 blocks,
# 12 heads of 128 = 1536 wide, FFN 8960) and "Wan-T2V-14B" (40 blocks, 40 heads of 128 = 5120 wide, FFN 13824);
# rope_max_seq_len is the class default the published files record (1024)
WAN_T2V = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                added_kv_proj_dim=None, rope_max_seq_len=1024)
WAN21_T2V_1_3B = dict(WAN_T2V, num_attention_heads=12, num_layers=30, ffn_dim=8960)
WAN21_T2V_14B = dict(WAN_T2V, num_attention_heads=40, num_layers=40, ffn_dim=13824)
PIPELINE_KEYS = ("boundary_ratio", "expand_timesteps")  # Wan2.2's WanPipeline entries kept beside the transformer's
# text_encoder/config.json: google/umt5-xxl's encoder (UMT5EncoderModel; the conversion script loads that repository)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                dropout_rate=0.1, layer_norm_epsilon=1e-6, is_encoder_decoder=False, use_cache=False,
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# vae/config.json: pipelines/components.py WAN21_VAE


def wan_published(hub_id: str, transformer: dict, title: str, arch: str, vae: dict = WAN21_VAE) -> ModelConfigs:
    return ModelConfigs(transformer, {"text_encoder": Component("transformers:UMT5EncoderModel", UMT5_XXL)},
                        Component("diffusers:AutoencoderKLWan", vae), hub_id, title, arch)


def is_wan22(pipeline_config, has_transformer_2: bool) -> bool:
    """Whether a WanPipeline config (``model_index.json``) is Wan2.2's: a second expert, a boundary or
    per-token timesteps."""
    return has_transformer_2 or pipeline_config.get("boundary_ratio") is not None or \
        bool(pipeline_config.get("expand_timesteps"))


class WanFamilyPolicy(DiffusersPolicy):
    """What the Wan adapters share (module doc); ``wan22`` tells the generation the adapter loads.

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

    wan22: ClassVar[bool] = False  # Wan2.2's pipelines (two experts, or per-token timesteps) vs Wan2.1's
    pipeline_class = "WanPipeline"
    transformer_class = "WanTransformer3DModel"
    lora_target_modules = WAN_LORA_TARGET_MODULES
    tiny_num_frames = TINY_NUM_FRAMES
    text_encoder_names = ("text_encoder",)
    cond_keys = ("prompt_embeds",)  # _forward(x, sigma, *these) (base velocity, on [B, C, F', h, w])

    def __init__(self, pipe, *, guidance_scale: Guidance = 5.0, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 512, num_frames: Optional[PositiveInt] = None, shift: Shift = None,
                 schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        self._check_variant(pipe)
        num_frames = DEFAULT_NUM_FRAMES if num_frames is None else num_frames
        sched = pipe.scheduler.config
        if shift is None:
            shift = (sched.get("flow_shift") if sched.get("use_flow_sigmas") else sched.get("shift")) or 1.0
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=float(shift), schedule=schedule,
                           num_frames=num_frames)
        ft = int(pipe.vae_scale_factor_temporal)
        if (num_frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for Wan's video VAE, got {num_frames!r}")
        pipe.vae_scale_factor = pipe.vae_scale_factor_spatial  # the name the base's _setup reads
        self._setup(pipe, device)  # frozen VAE / text encoder, LoRA targets, negative cache
        cfg = self.transformer.config
        f, (_, ph, pw) = self.vae_scale_factor, cfg.patch_size
        if ph != pw:
            raise ValueError(f"Wan expects a square spatial patch, got patch_size={tuple(cfg.patch_size)}")
        self.height, self.width = resolve_resolution(resolution, DEFAULT_RESOLUTION, f * ph)
        self.latent_shape = (int(cfg.in_channels), (num_frames - 1) // ft + 1, self.height // f,
                             self.width // f)  # (C, F', h, w)

    @classmethod
    def _check_variant(cls, pipe) -> None:
        """``wan`` takes Wan2.1 pipelines, ``wan2.2`` Wan2.2's (two experts, or TI2V-5B's per-token timesteps)."""
        two = getattr(pipe, "transformer_2", None) is not None
        wan22 = is_wan22(pipe.config, two)
        if wan22 != cls.wan22:
            raise ValueError(f"this is a Wan{'2.2' if wan22 else '2.1'} pipeline: load it with model.pipeline: "
                             f"{'wan2.2' if wan22 else 'wan'}")
        if wan22 and (getattr(pipe, "transformer", 1) is None or two != (pipe.config.get("boundary_ratio") is not None)):
            raise ValueError("a Wan2.2 pipeline needs transformer, and transformer_2 with boundary_ratio (T2V-A14B) or "
                             "neither (TI2V-5B)")

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def model_configs(cls, path):
        """The base's, refusing a local directory of the other Wan generation (``_check_variant``); a Wan2.2
        one's transformer config gains its pipeline's ``PIPELINE_KEYS``, as the published ones have them."""
        root = Path(os.path.expanduser(str(path or "")))
        if not (path and (root / "model_index.json").is_file()):
            return super().model_configs(path)
        index = json.loads((root / "model_index.json").read_text())
        two = bool((index.get("transformer_2") or [None])[0])
        cls._check_variant(SimpleNamespace(config=index, transformer_2=two or None))
        configs = super().model_configs(path)
        if two:
            check_second_expert(root, configs.transformer)
        extra = {k: index[k] for k in PIPELINE_KEYS if index.get(k) is not None}
        return dataclasses.replace(configs, transformer={**configs.transformer, **extra})

    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        """Spatial pixels per latent pixel: the VAE's ``scale_factor_spatial``, else 2 per downsampling stage
        (``temperal_downsample`` has one entry per stage; 8 for Wan2.1's three)."""
        vae = configs.vae.config
        return int(vae.get("scale_factor_spatial") or 2 ** len(vae["temperal_downsample"]))

    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        """The spatial patch (``patch_size`` is ``(t, h, w)``)."""
        return int(transformer["patch_size"][1])

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        """``options['num_frames']`` video frames (default 81, ``4 k + 1``) of ``options['resolution']``
        (default 480 x 832): latents ``(C, (F - 1) / 4 + 1, H / f, W / f)`` (f = 8; TI2V-5B 16)."""
        f = cls.vae_factor(configs)
        vae = configs.vae.config
        ft = int(vae.get("scale_factor_temporal") or 2 ** sum(map(bool, vae["temperal_downsample"])))  # 4
        frames = options.get("num_frames") or DEFAULT_NUM_FRAMES
        if not isinstance(frames, int) or (frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for Wan's video VAE, got {frames!r}")
        h, w = resolve_resolution(options.get("resolution") or DEFAULT_RESOLUTION, 0,
                                  f * cls.patch_size(configs.transformer))
        shape = (int(configs.transformer["in_channels"]), (frames - 1) // ft + 1, h // f, w // f)  # (C, F', h, w)
        return Geometry(h, w, shape, cls.text_tokens(options), frames)

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """UMT5 embeddings ``[rows, L, text_dim]`` (no mask: the pipeline passes none)."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["text_dim"],
                                             device=device, dtype=dtype)}  # [B, L, D]

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, expand_timesteps: Optional[bool] = None,
                           **settings) -> dict:
        """Latents ``[B, C, F', h, w]``, ``timestep = sigma * 1000`` (the pipeline's ``scheduler.timesteps``); with
        ``expand_timesteps`` (Wan2.2 TI2V-5B: the policy's setting, else the config's entry) one per token ``[B,
        F' (h / ph) (w / pw)]``, each at its row's ``t``, as WanPipeline's text-to-video loop (mask all ones)."""
        t = sigma * 1000.0  # [B]
        if config.get("expand_timesteps") if expand_timesteps is None else expand_timesteps:
            _, ph, pw = config["patch_size"]
            t = t[:, None].expand(-1, x.shape[2] * (x.shape[3] // ph) * (x.shape[4] // pw))  # [B, L]
        return dict(hidden_states=x.to(dtype), timestep=t,
                    encoder_hidden_states=cond["prompt_embeds"].to(x.device, dtype), return_dict=False)  # [B, L, D]

    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """One ``WanTransformer3DModel``; with Wan2.2's ``boundary_ratio`` the two experts (``TwoExperts``)."""
        plain = {k: v for k, v in transformer.items() if k not in PIPELINE_KEYS}
        if transformer.get("boundary_ratio") is None:
            return super().transformer_component(plain, options)
        return experts_component(plain, transformer["boundary_ratio"], cls.transformer_class, options)

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return dict(patch_size=transformer["patch_size"], num_attention_heads=2, attention_head_dim=12,
                    in_channels=transformer["in_channels"], out_channels=transformer["out_channels"], text_dim=32,
                    freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                    rope_max_seq_len=32, **{k: transformer[k] for k in PIPELINE_KEYS if k in transformer})

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

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                        max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": pe}  # [B, L, D], zero past each prompt's tokens

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: UMT5 ``prompt_embeds`` [B, max_sequence_length, D]; with guidance
        also the cached ``negative_prompt_embeds``."""
        return super().encode_prompts(prompts)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F', h, w]`` -> float32 videos ``[B, 3, F, f h, f w]`` in [0, 1] (module doc)."""
        return video_vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, F, H, W]


__all__ = ["DEFAULT_NUM_FRAMES", "DEFAULT_RESOLUTION", "PIPELINE_KEYS", "TINY_NUM_FRAMES", "UMT5_XXL", "WAN_T2V",
           "WAN21_T2V_14B", "WAN21_T2V_1_3B", "WAN_LORA_TARGET_MODULES", "WanFamilyPolicy", "is_wan22", "wan_published"]
