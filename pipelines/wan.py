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

from typing import Optional, Union

import torch

from flowrl.schedules import flow_sigmas

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, resolve_resolution
from .components import WAN21_VAE
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
_WAN_T2V = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None,
                added_kv_proj_dim=None, rope_max_seq_len=1024)
WAN21_T2V_1_3B = dict(_WAN_T2V, num_attention_heads=12, num_layers=30, ffn_dim=8960)
WAN21_T2V_14B = dict(_WAN_T2V, num_attention_heads=40, num_layers=40, ffn_dim=13824)
# text_encoder/config.json: google/umt5-xxl's encoder (UMT5EncoderModel; the conversion script loads that repository)
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                dropout_rate=0.1, layer_norm_epsilon=1e-6, is_encoder_decoder=False, use_cache=False,
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# vae/config.json: pipelines/components.py WAN21_VAE


def _published(hub_id: str, transformer: dict, title: str, arch: str) -> ModelConfigs:
    return ModelConfigs(transformer, {"text_encoder": Component("transformers:UMT5EncoderModel", UMT5_XXL)},
                        Component("diffusers:AutoencoderKLWan", WAN21_VAE), hub_id, title, arch)


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
    cond_keys = ("prompt_embeds",)  # _forward(x, sigma, *these) (base velocity, on [B, C, F', h, w])
    published = {m.source: m for m in (
        _published(example_hub_id, WAN21_T2V_1_3B, "Wan2.1-T2V-1.3B", "wan-1.3b-arch"),
        _published("Wan-AI/Wan2.1-T2V-14B-Diffusers", WAN21_T2V_14B, "Wan2.1-T2V-14B", "wan-14b-arch"))}

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
        self.height, self.width = resolve_resolution(resolution, DEFAULT_RESOLUTION, f * ph)
        self.latent_shape = (int(cfg.in_channels), (num_frames - 1) // ft + 1, self.height // f,
                             self.width // f)  # (C, F', h, w)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        """Spatial pixels per latent pixel: 2 per downsampling stage (``temperal_downsample`` has one entry
        per stage; 8 for Wan2.1's three)."""
        return 2 ** len(configs.vae.config["temperal_downsample"])

    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        """The spatial patch (``patch_size`` is ``(t, h, w)``)."""
        return int(transformer["patch_size"][1])

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        """``options['num_frames']`` video frames (default 81, ``4 k + 1``) of ``options['resolution']``
        (default 480 x 832): latents ``(C, (F - 1) / 4 + 1, H / 8, W / 8)``."""
        f = cls.vae_factor(configs)
        ft = 2 ** sum(bool(d) for d in configs.vae.config["temperal_downsample"])  # 4: temporal factor
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
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Latents ``[B, C, F', h, w]``, ``timestep = sigma * 1000`` (the pipeline's ``scheduler.timesteps``)."""
        return dict(hidden_states=x.to(dtype), timestep=sigma * 1000.0,
                    encoder_hidden_states=cond["prompt_embeds"].to(x.device, dtype), return_dict=False)  # [B, L, D]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return dict(patch_size=transformer["patch_size"], num_attention_heads=2, attention_head_dim=12,
                    in_channels=transformer["in_channels"], out_channels=transformer["out_channels"], text_dim=32,
                    freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                    rope_max_seq_len=32)

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
    def tiny_options(cls, kind: str) -> dict:
        return {"num_frames": TINY_NUM_FRAMES}  # the tiny model's default video length (flowrl.json)

    def saved_options(self) -> dict:
        return {"num_frames": self.num_frames}  # the default when loaded back

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                        max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": pe}  # [B, L, D], zero past each prompt's tokens

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: UMT5 ``prompt_embeds`` [B, max_sequence_length, D]; with guidance
        also the cached ``negative_prompt_embeds``."""
        return super().encode_prompts(prompts)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]`` float32 from 1 to 0: ``flow_sigmas(num_steps, shift, schedule)``."""
        return flow_sigmas(num_steps, self.shift, self.schedule)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F', h, w]`` -> float32 videos ``[B, 3, F, 8h, 8w]`` in [0, 1] (module doc)."""
        return video_vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, F, H, W]


__all__ = ["DEFAULT_NUM_FRAMES", "DEFAULT_RESOLUTION", "TINY_NUM_FRAMES", "WAN_LORA_TARGET_MODULES", "WanPolicy"]
