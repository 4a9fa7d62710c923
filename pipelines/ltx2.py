"""LTX-2 (Lightricks 2026, 19B; github.com/Lightricks/LTX-2) text-to-audio-video as a ``FlowPolicy``
(``model.pipeline: ltx2``), over diffusers ``LTX2Pipeline`` components; its published configs, tiny components and
guidance math are in ``pipelines/ltx2_components.py``.

**Two latent streams in one tensor.** LTX-2 denoises a video and its soundtrack together: one asymmetric dual-stream
DiT (``LTX2VideoTransformer3DModel``: a video stream and an audio stream joined by cross-attention both ways) takes
the video latents as tokens ``[B, S_v, 128]`` (the video VAE's 128 channels, ``S_v = F' h w`` with ``F' = (F - 1) / 8
+ 1`` latent frames of ``H / 32 x W / 32``) and the audio latents as tokens ``[B, S_a, 128]`` (the audio VAE's 8
channels x 16 mel bins of each of ``S_a`` latent audio frames, 25 per second of video) and predicts both. The policy's
latents are **one tensor**, ``[B, S_v + S_a, 128]``: the pipeline's packed video tokens followed by its packed audio
tokens (both in the space the pipeline denoises: the video's normalized latents, the audio's normalized latents), so
the samplers, the step functions, the stored transitions and every update see one state and need no change: an SDE
step noises both streams, a transition's log-probability is the Gaussian's over both (flowrl's log-probs are
**means** over elements, so the audio's ~2% of the elements at the published size weigh ~2%), and training moves
both. ``velocity`` splits the tensor at ``S_v``, runs the transformer and concatenates its two predictions. (The first
peer, Flow-Factory's ``ltx2_t2av`` adapter, concatenates the streams the same way but steps the audio by an ODE
without log-probability; here the audio is part of the explored and trained state.) The layout needs the video
channels to equal the audio token width (128 and 8 x 16 in every published LTX-2); a model without it is refused.

**Rewards see the frames only.** ``decode`` returns the videos ``[B, 3, F, H, W]`` in [0, 1] (video tokens unpacked
to ``[B, 128, F', h, w]``, ``z std / scaling_factor + mean`` per channel, VAE decode at decode timestep 0, ``x / 2 +
0.5`` clamped): rewards, strips and GIFs go through the paths Wan's videos take; **the audio is not scored** (no
flowrl reward reads sound). :meth:`LTX2Policy.decode_audio` gives the waveform (``z std + mean``, audio VAE, vocoder)
for listening.

**Conventions** (``LTX2Pipeline.__call__``). Rectified flow with the SD3 velocity convention; the transformer's time
input is ``timestep = sigma * 1000`` (``scheduler.timesteps``, also its ``sigma`` input), the same for both streams.
Guidance: the pipeline converts each prediction to ``x0 = x - sigma v``, adds ``(s - 1) (x0_c - x0_u)`` per stream
(video ``guidance_scale``, audio ``audio_guidance_scale``), optionally rescales (``guidance_rescale``, Lin et al. 2024,
arXiv 2305.08891, per stream), and converts back; ``ltx2_components.ltx2_guidance`` is that, on one doubled batch.
The pipeline's spatio-temporal guidance (``stg_scale``) and modality-isolation guidance (``modality_scale``) need extra transformer
passes per step and are not run: compare with the pipeline at ``stg_scale=0, modality_scale=1``.

**Text.** The pipeline's own encoding: Gemma 3 on the left-padded prompt (``max_sequence_length`` tokens), every
hidden layer stacked per token, then the frozen text connectors (``LTX2TextConnectors``, a pipeline component:
per-layer masked normalization, a projection, a 1D transformer per stream with learned registers in the padding);
the conditioning is their video and audio embeddings and mask. Both text encoder and connectors are frozen
(``text_encoder_names``) and dropped by the text-embedding cache.

**Schedule.** The pipeline's: ``linspace(1, 1/T, T)`` through its scheduler at ``mu`` of the video token count
(``calculate_shift``: 0.95 -> 2.05 over 1024 -> 4096 tokens), with its ``shift_terminal`` (0.1), then 0.

**Context parallelism is refused** (``context_parallel_refusal``; ``train.context_parallel`` > 1 is one line when the
config loads). diffusers 0.42.1 declares a ``_cp_plan`` for ``LTX2VideoTransformer3DModel`` that does not run: it
splits the video tokens and the ``rope`` module's outputs as ``[B, T, D]`` tensors, but LTX-2's split RoPE (``rope_type:
split``, every published config) returns ``[B, H, T, D / 2]``, which the plan passes whole, so the split tokens meet
unsplit positions (tests/test_ltx2.py shows the shape error on the tiny model); the cross-modal attention's RoPE
(``cross_attn_rope``) is not in the plan either, and with both corrected the masked text cross-attention still fails
inside diffusers' Ulysses attention.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from flowrl.options import Fraction, Guidance, PositiveFloat, PositiveInt

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import (Resolution, Schedule, Shift, TextTokens, cfg_halves, module_dtype, resolve_resolution,
                     scheduler_sigmas, transformer_dtype)
from .facts import Component, Geometry, ModelConfigs
from .ltx2_components import (DEFAULT_FRAME_RATE, DEFAULT_NUM_FRAMES, DEFAULT_RESOLUTION, FSDP_UNITS, GEMMA3_12B,
                              LTX2_19B, LTX2_CONNECTORS, LTX2_VAE, TINY_NUM_FRAMES, audio_frames, calculate_shift,
                              ltx2_guidance, tiny_ltx2_components)

# Flow-Factory's default LoRA targets for LTX-2 (src/flow_factory/models/ltx2/ltx2_t2av.py; r=64, alpha=128): every
# block's video and audio self- and text cross-attention, both cross-modal attentions (q / k / v / out each) and both
# feed-forwards: 28 linear layers per block
LTX2_LORA_TARGET_MODULES = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "audio_attn1.to_q", "audio_attn1.to_k", "audio_attn1.to_v", "audio_attn1.to_out.0",
    "audio_attn2.to_q", "audio_attn2.to_k", "audio_attn2.to_v", "audio_attn2.to_out.0",
    "audio_to_video_attn.to_q", "audio_to_video_attn.to_k", "audio_to_video_attn.to_v", "audio_to_video_attn.to_out.0",
    "video_to_audio_attn.to_q", "video_to_audio_attn.to_k", "video_to_audio_attn.to_v", "video_to_audio_attn.to_out.0",
    "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2",
)
class LTX2Policy(DiffusersPolicy):
    """``FlowPolicy`` for LTX-2 text-to-audio-video (module doc).

    Args:
        pipe: a loaded ``LTX2Pipeline`` (its components are used, not its loop).
        guidance_scale: the video stream's CFG scale; 1.0 = none. Default 4.0 (the diffusers LTX-2 example's and
            Flow-Factory's evaluation setting).
        audio_guidance_scale: the audio stream's CFG scale; None = ``guidance_scale`` (the pipeline's None). CFG runs
            (one doubled batch) when either scale is above 1, as the pipeline's.
        guidance_rescale: the video stream's rescale ``phi`` (0 = none, Flow-Factory's setting);
            ``audio_guidance_rescale``: the audio's (None = ``guidance_rescale``).
        negative_prompt: the unconditional prompt (the pipeline's default ``""``).
        max_sequence_length: Gemma tokens (the pipeline's default 1024; a multiple of the connectors' 128 registers).
        num_frames: video frames ``F``, ``8k + 1`` (the VAE's temporal factor k + 1); None = ``flowrl.json``'s, else
            the pipeline's 121.
        frame_rate: frames per second (the pipeline's 24): the audio's length and the video RoPE's time scale.
        shift: None (default) = the pipeline's schedule; a float replaces it by ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: frame size in pixels, int or (H, W), multiples of 32; None = ``flowrl.json``'s, else the
            pipeline's (512, 768).
        device: where the models and all returned tensors live.
    """

    kind = "ltx2"
    pipeline_class = "LTX2Pipeline"
    transformer_class = "LTX2VideoTransformer3DModel"
    lora_target_modules = LTX2_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder", "connectors")
    tiny_kinds = ("ltx2",)
    tiny_num_frames = TINY_NUM_FRAMES
    example_hub_id = "Lightricks/LTX-2"
    cond_keys = ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")
    published = {example_hub_id: ModelConfigs(
        LTX2_19B, {"text_encoder": Component("transformers:Gemma3ForConditionalGeneration", GEMMA3_12B),
                   "connectors": Component("diffusers.pipelines.ltx2:LTX2TextConnectors", LTX2_CONNECTORS)},
        Component("diffusers:AutoencoderKLLTX2Video", LTX2_VAE), example_hub_id, "LTX-2 (19B)", "ltx2-arch")}
    smoke_model_options = {"num_frames": TINY_NUM_FRAMES}
    context_parallel_refusal = (
        "LTX-2's diffusers _cp_plan does not run in diffusers 0.42.1 (it splits RoPE outputs of 3 dims, LTX-2's split "
        "RoPE gives 4, so the video tokens are split and their positions not; the cross-modal RoPE is not split; "
        "its masked text attention fails under Ulysses): LTX-2 trains without context parallelism")

    def __init__(self, pipe, *, guidance_scale: Guidance = 4.0, audio_guidance_scale: Optional[Guidance] = None,
                 guidance_rescale: Fraction = 0.0, audio_guidance_rescale: Optional[Fraction] = None,
                 negative_prompt: str = "", max_sequence_length: TextTokens = 1024,
                 num_frames: Optional[PositiveInt] = None, frame_rate: PositiveFloat = DEFAULT_FRAME_RATE,
                 shift: Shift = None, schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        num_frames = DEFAULT_NUM_FRAMES if num_frames is None else num_frames
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                           num_frames=num_frames, frame_rate=float(frame_rate),
                           audio_guidance_scale=audio_guidance_scale, guidance_rescale=float(guidance_rescale),
                           audio_guidance_rescale=audio_guidance_rescale)
        self.audio_guidance_scale = float(guidance_scale if audio_guidance_scale is None else audio_guidance_scale)
        self.audio_guidance_rescale = float(guidance_rescale if audio_guidance_rescale is None
                                            else audio_guidance_rescale)
        ft = int(pipe.vae_temporal_compression_ratio)
        if (num_frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for LTX-2's video VAE, got {num_frames!r}")
        cfg = pipe.transformer.config
        audio_width = int(pipe.audio_vae.config.latent_channels) * (int(pipe.audio_vae.config.mel_bins)
                                                                   // int(pipe.audio_vae_mel_compression_ratio))
        if not (cfg.in_channels == cfg.audio_in_channels == audio_width and cfg.patch_size == cfg.patch_size_t == 1):
            raise ValueError(f"LTX2Policy carries video and audio tokens in one tensor: it needs video channels "
                             f"({cfg.in_channels}) = audio token width ({cfg.audio_in_channels}, audio VAE "
                             f"{audio_width}) and unpatched video tokens; this model has neither")
        registers = pipe.connectors.config.video_connector_num_learnable_registers if pipe.connectors else None
        if registers and max_sequence_length % registers:
            raise ValueError(f"model.options.max_sequence_length={max_sequence_length}: LTX-2's text connectors fill "
                             f"the padding with {registers} learned registers, so it must be a multiple of {registers}")
        pipe.vae_scale_factor = pipe.vae_spatial_compression_ratio  # the name the base's _setup reads
        pipe.transformer._no_split_modules = FSDP_UNITS  # see FSDP_UNITS
        self._setup(pipe, device)  # frozen VAE / text encoder / connectors, LoRA targets, negative cache
        for name in ("audio_vae", "vocoder"):
            getattr(pipe, name).requires_grad_(False).eval()
        f = self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, DEFAULT_RESOLUTION, f)
        self.video_shape = ((num_frames - 1) // ft + 1, self.height // f, self.width // f)  # (F', h, w)
        self.video_tokens = int(np.prod(self.video_shape))
        self.audio_frames = audio_frames(num_frames, self.frame_rate, pipe.audio_sampling_rate, pipe.audio_hop_length,
                                         pipe.audio_vae_temporal_compression_ratio)
        self.latent_shape = (self.video_tokens + self.audio_frames, int(cfg.in_channels))  # (S_v + S_a, C)
        _notice_audio_unscored()

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        return int(configs.vae.config["spatial_compression_ratio"])

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        """``options['num_frames']`` video frames (default 121, ``8 k + 1``) of ``options['resolution']`` (default
        512 x 768): the planner's latents are the video's ``(128, F', H / 32, W / 32)`` (the transformer call adds the
        audio tokens of the frame rate's duration: :meth:`transformer_inputs`), and the bytes of a stored latent count
        the audio tokens too (:class:`AudioVideoGeometry`)."""
        f, vae = cls.vae_factor(configs), configs.vae.config
        ft = int(vae["temporal_compression_ratio"])
        frames = options.get("num_frames") or DEFAULT_NUM_FRAMES
        if not isinstance(frames, int) or (frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for LTX-2's video VAE, got {frames!r}")
        h, w = resolve_resolution(options.get("resolution") or DEFAULT_RESOLUTION, 0, f)
        c = configs.transformer
        shape = (int(c["in_channels"]), (frames - 1) // ft + 1, h // f, w // f)  # (C, F', h, w)
        audio = audio_frames(frames, float(options.get("frame_rate") or DEFAULT_FRAME_RATE),
                             c.get("audio_sampling_rate", 16000), c.get("audio_hop_length", 160),
                             c.get("audio_scale_factor", 4))
        return AudioVideoGeometry(h, w, shape, cls.text_tokens(options), frames, audio * int(c["audio_in_channels"]))

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """The connectors' video and audio text embeddings ``[rows, L, caption_channels]`` and their int64 mask."""
        c = configs.transformer
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, c["caption_channels"], device=device,
                                             dtype=dtype),  # [B, L, D]
                "audio_prompt_embeds": torch.empty(rows, geometry.text_tokens, c["caption_channels"], device=device,
                                                   dtype=dtype),  # [B, L, D]
                "prompt_attention_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.int64)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, video_shape: Optional[tuple] = None,
                           audio_frames: Optional[int] = None, frame_rate: float = DEFAULT_FRAME_RATE,
                           **settings) -> dict:
        """The transformer's keywords, as ``LTX2Pipeline`` passes them (``timestep`` and ``sigma`` = ``sigma *
        1000``, RoPE positions from the latent sizes and ``fps = frame_rate``, the one text mask for both streams).

        ``x`` is the policy's ``[B, S_v + S_a, C]`` with ``video_shape`` ``(F', h, w)`` and ``audio_frames`` ``S_a``
        (its :meth:`forward_settings`), or, for ``flowrl plan`` and the architecture benchmark, the video latents
        ``[B, C, F', h, w]`` alone: the audio tokens are then zeros of the length ``frame_rate`` gives the clip."""
        if x.ndim == 5:  # the planner's video latents
            b, c, f, h, w = x.shape
            video = x.permute(0, 2, 3, 4, 1).reshape(b, f * h * w, c)  # [B, S_v, C] (the pipeline's _pack_latents)
            frames = (f - 1) * int(config["vae_scale_factors"][0]) + 1
            audio = torch.zeros(b, _audio_frames_of(config, frames, frame_rate), config["audio_in_channels"],
                                device=x.device, dtype=dtype)  # [B, S_a, C]
            video_shape = (f, h, w)
        else:
            if video_shape is None or audio_frames is None:
                raise ValueError("LTX-2's packed latents [B, S_v + S_a, C] need video_shape and audio_frames "
                                 "(the policy's forward_settings)")
            split = int(np.prod(video_shape))
            video, audio = x[:, :split], x[:, split:]  # [B, S_v, C], [B, S_a, C]
        t = sigma * 1000.0  # [B]
        dev = x.device
        text_mask = cond["prompt_attention_mask"].to(dev)  # [B, L]
        return dict(hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype),
                    encoder_hidden_states=cond["prompt_embeds"].to(dev, dtype),  # [B, L, D]
                    audio_encoder_hidden_states=cond["audio_prompt_embeds"].to(dev, dtype),  # [B, L, D]
                    timestep=t, sigma=t, encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask,
                    num_frames=video_shape[0], height=video_shape[1], width=video_shape[2], fps=float(frame_rate),
                    audio_num_frames=audio.shape[1], isolate_modalities=False, use_cross_timestep=True,
                    return_dict=False)

    @classmethod
    def transformer_output(cls, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The video prediction ``[B, S_v, C]`` as the planner's video latents ``[B, C, F', h, w]`` (the policy's own
        forward concatenates both predictions: :meth:`_forward`)."""
        if x.ndim != 5:
            return out
        b, c, f, h, w = x.shape
        return out.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)  # [B, C, F', h, w]

    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """The diffusers transformer with its blocks as FSDP units (:data:`FSDP_UNITS`; :func:`ltx2_transformer`)."""
        return Component("flowrl.pipelines.ltx2_components:ltx2_transformer", transformer)

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
                "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
                "num_layers": 2, "caption_channels": 32, "rope_double_precision": False}

    @classmethod
    def tiny_multiple(cls) -> int:
        return 8  # the tiny video VAE's spatial factor (published: 32)

    @classmethod
    def tiny_components(cls, kind: str = "ltx2", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``LTX2Pipeline`` of the published layout at toy widths (``ltx2_components.tiny_ltx2_components``):
        the transformer is the published config shrunk (:meth:`shrink_config`) on the tiny VAE's factors."""
        return tiny_ltx2_components({**cls.shrink_config(LTX2_19B), "vae_scale_factors": (4, 8, 8)}, seed)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.pipe
        pe, mask = pipe._get_gemma_prompt_embeds(list(prompts), max_sequence_length=self.max_sequence_length,
                                                 device=self.device)  # [B, L, D (layers + 1)], [B, L]
        video, audio, video_mask = pipe.connectors(pe, mask, padding_side=pipe.tokenizer.padding_side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio,  # [B, L, D] each
                "prompt_attention_mask": video_mask.long()}  # [B, L]

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: the connectors' video and audio embeddings [B, max_sequence_length, D] and their
        mask [B, max_sequence_length]; with guidance also the cached ``negative_*``."""
        return super().encode_prompts(prompts)

    @property
    def cfg_scale(self) -> float:
        """The larger stream scale: CFG runs when either stream's scale is above 1, as in the pipeline."""
        return max(self.guidance_scale, self.audio_guidance_scale)

    def forward_settings(self) -> dict:
        return {"video_shape": self.video_shape, "audio_frames": self.audio_frames, "frame_rate": self.frame_rate}

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, *entries: torch.Tensor) -> torch.Tensor:
        """Both streams' predictions ``[B, S_v + S_a, C]`` (the transformer's dtype) for latents ``x`` of that
        shape."""
        config = getattr(self.transformer, "module", self.transformer).config  # also under a DDP wrapper
        kw = self.transformer_inputs(config, transformer_dtype(self.transformer), x, sigma,
                                     dict(zip(self.cond_keys, entries)), **self.forward_settings())
        video, audio = self.transformer(**kw)[:2]  # [B, S_v, C], [B, S_a, C]
        return torch.cat([video, audio], dim=1)  # [B, S_v + S_a, C]

    def velocity(self, latents: torch.Tensor, sigma, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 ``[B, S_v + S_a, C]``; with guidance (either stream's scale above 1) the
        pipeline's per-stream x0-space CFG and rescale (:func:`ltx2_guidance`) on one doubled batch
        (``pipelines.common.cfg_halves``; ``cfg_uncond_grad`` off: the unconditional half without gradient)."""
        x = latents.to(self.device)  # [B, S, C]
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        text = (x, sigma, *(cond[k] for k in self.cond_keys))
        if self.cfg_scale == 1.0:
            return self._forward(*text).float()
        uncond = (x, sigma, *(cond["negative_" + k] for k in self.cond_keys))
        u, c = cfg_halves(self._forward, uncond, text, uncond_grad=self.cfg_uncond_grad)  # [B, S, C] each
        if not self.cfg_uncond_grad:
            u = u.detach()
        return ltx2_guidance(x, sigma, u, c, self.video_tokens, (self.guidance_scale, self.audio_guidance_scale),
                             (self.guidance_rescale, self.audio_guidance_rescale))

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas ``LTX2Pipeline`` gives its scheduler at this video size (module doc)."""
        cfg = self.pipe.scheduler.config
        mu = calculate_shift(self.video_tokens, cfg.get("base_image_seq_len", 1024), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.95), cfg.get("max_shift", 2.05))
        return scheduler_sigmas(self.pipe.scheduler, np.linspace(1.0, 1 / num_steps, num_steps), mu)

    def split(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's latents ``[B, S_v + S_a, C]`` as the video latents ``[B, C, F', h, w]`` and the audio latents
        ``[B, channels, S_a, mel bins]``, both still normalized (the pipeline's ``_unpack_latents`` /
        ``_unpack_audio_latents``)."""
        b, _, c = latents.shape
        f, h, w = self.video_shape
        video = latents[:, :self.video_tokens].reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)  # [B, C, F', h, w]
        mel = int(self.pipe.audio_vae.config.mel_bins) // int(self.pipe.audio_vae_mel_compression_ratio)
        audio = latents[:, self.video_tokens:].unflatten(2, (-1, mel)).transpose(1, 2)  # [B, c_a, S_a, mel]
        return video, audio

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, S_v + S_a, C]`` -> float32 videos ``[B, 3, F, H, W]`` in [0, 1] from the video tokens
        (module doc); the audio tokens are not decoded (:meth:`decode_audio`)."""
        vae = self.vae
        dtype = module_dtype(vae)
        video, _ = self.split(latents.to(self.device))  # [B, C, F', h, w]
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(self.device, dtype)  # [1, C, 1, 1, 1]
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(self.device, dtype)
        step = self.decode_batch or max(1, len(video))
        out = []
        for i in range(0, len(video), step):
            z = video[i:i + step].to(dtype) * std / vae.config.scaling_factor + mean  # [b, C, F', h, w]
            temb = torch.zeros(len(z), device=self.device, dtype=dtype) if vae.config.timestep_conditioning else None
            with torch.no_grad():
                frames = vae.decode(z, temb, return_dict=False)[0]  # [b, 3, F, H, W] in [-1, 1]
            out.append((frames.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out)  # [B, 3, F, H, W]

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, S_v + S_a, C]`` -> float32 waveforms ``[B, channels, samples]`` at the vocoder's
        ``output_sampling_rate`` from the audio tokens: ``z std + mean`` per token feature, the audio VAE's mel
        spectrogram, the vocoder (``LTX2Pipeline``'s audio decode). Not used by rewards."""
        avae, vocoder = self.pipe.audio_vae, self.pipe.vocoder
        dtype = module_dtype(avae)
        tokens = latents[:, self.video_tokens:].to(self.device, dtype)  # [B, S_a, C]
        tokens = tokens * avae.latents_std.to(self.device, dtype) + avae.latents_mean.to(self.device, dtype)
        _, audio = self.split(torch.cat([latents[:, :self.video_tokens].to(tokens), tokens], dim=1))
        with torch.no_grad():
            mel = avae.decode(audio, return_dict=False)[0]  # [B, 2, T, mel_bins]
            return vocoder(mel.to(module_dtype(vocoder))).float()  # [B, channels, samples]


@dataclass(frozen=True)
class AudioVideoGeometry(Geometry):
    """A :class:`Geometry` whose ``latent_shape`` is the video's and whose stored-latent bytes also count
    ``audio_elements`` (the audio tokens' elements the policy's latents carry)."""

    audio_elements: int = 0

    @property
    def latent_bytes(self) -> int:
        return (int(np.prod(self.latent_shape)) + self.audio_elements) * 4


_NOTICED: list[bool] = []


def _notice_audio_unscored() -> None:
    """Once per process: rewards score LTX-2's frames, not its soundtrack."""
    if not _NOTICED:
        _NOTICED.append(True)
        print("[flowrl] LTX-2 generates audio with the video: the rollouts and training carry both, rewards score "
              "the frames only (the audio is not scored; LTX2Policy.decode_audio gives the waveform)",
              file=sys.stderr, flush=True)


def _audio_frames_of(config, frames: int, frame_rate: float) -> int:
    """Latent audio frames of ``frames`` video frames by the transformer ``config``'s audio settings."""
    return audio_frames(frames, frame_rate, config.get("audio_sampling_rate", 16000),
                        config.get("audio_hop_length", 160), config.get("audio_scale_factor", 4))


__all__ = ["AudioVideoGeometry", "LTX2_LORA_TARGET_MODULES", "LTX2Policy"]
