"""SANA (Xie et al. 2024; the model of Sol-RL) as a ``FlowPolicy``, over diffusers ``SanaPipeline`` components.

Latents are the DC-AE's (``AutoencoderDC``) ``[B, 32, H/32, W/32]``; the linear-attention DiT
(``SanaTransformer2DModel``, patch 1) is the trainable part, the Gemma-2 text encoder and the
DC-AE are frozen. SANA is a rectified-flow model with the same velocity convention as SD3
(``x_sigma = (1 - sigma) x0 + sigma noise``, prediction ``noise - x0``); its time input is
``timestep = sigma * 1000 * transformer.config.timestep_scale`` (the pipeline passes
``scheduler.timesteps * timestep_scale``; ``timestep_scale`` is 1 for SANA).

Prompts are encoded by the pipeline's own ``SanaPipeline.encode_prompt``: the complex human
instruction (CHI) prefix is prepended as ``SanaPipeline.__call__`` does by default, and the first
token plus the last ``max_sequence_length - 1`` are kept (with their attention mask). The
negative prompt is encoded without the prefix, as the pipeline does. Guidance is classifier-free
(one doubled batch, uncond first). DC-AE latents are decoded as ``vae.decode(latents /
scaling_factor)`` (no shift factor).

Sampling: flowrl's step functions on ``flow_sigmas(T, shift)`` with SANA's flow shift (3.0 at
1024 px, from the scheduler's ``flow_shift`` or ``shift``); the diffusers pipeline's default
sampler is DPM-Solver++ on a similarly shifted schedule.
"""
from __future__ import annotations

import inspect
import string
from typing import Optional, Sequence, Union

import torch

from flowrl.schedules import flow_sigmas

from .base import IMAGE_SIZE, DiffusersPolicy, Resolution, resolve_resolution
from .common import transformer_dtype

# Sol-RL's SANA LoRA targets (NVlabs/Sana configs/sol_rl/sana.py: attn.qkv, attn.proj, cross_attn.q_linear,
# cross_attn.kv_linear, cross_attn.proj), in diffusers' module names: self-attention attn1 and
# cross-attention attn2, query / key / value and output projections.
SANA_LORA_TARGET_MODULES = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
)


def default_complex_human_instruction() -> list[str]:
    """The CHI prefix lines ``SanaPipeline.__call__`` uses by default (read from its signature)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


def build_gemma_tokenizer(model_max_length: int = 4096):
    """An offline ``GemmaTokenizer`` for tiny models: Gemma's special ids (``<pad>`` 0, ``<eos>`` 1,
    ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4), its 256 byte-fallback tokens, ``▁`` and the printable
    ASCII characters (character-level: no merges); a ``<bos>`` starts every sequence, as Gemma's."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in ["▁"] + sorted(set(string.printable) - set(string.whitespace)):
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length, add_bos_token=True)


class SanaPolicy(DiffusersPolicy):
    """``FlowPolicy`` for SANA (see module doc).

    Args:
        pipe: a loaded ``SanaPipeline`` (its components are used, not its loop).
        guidance_scale: CFG scale; 1.0 = no guidance (single pass). The pipeline's default is 4.5;
            Sol-RL samples SANA at 1.0.
        negative_prompt: the unconditional prompt for CFG.
        max_sequence_length: Gemma tokens kept per prompt (the pipeline's default 300).
        complex_human_instruction: the CHI prefix lines; None = the pipeline's default, ``[]`` = none.
        shift: the flow shift; None takes the scheduler's ``flow_shift`` or ``shift``.
        schedule: ``"diffusers"`` or ``"linear"`` (``flowrl.schedules.flow_sigmas``).
        resolution: image size in pixels, int or (H, W); None = ``flowrl.json``'s, else
            ``transformer.config.sample_size * vae_scale_factor`` (1024 for SANA-1600M-1024px).
        device: where the models and all returned tensors live.
    """

    kind = "sana"
    pipeline_class = "SanaPipeline"
    transformer_class = "SanaTransformer2DModel"
    lora_target_modules = SANA_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    tiny_kinds = ("sana",)
    example_hub_id = "Efficient-Large-Model/Sana_1600M_1024px_diffusers"

    def __init__(self, pipe, *, guidance_scale: float = 4.5, negative_prompt: str = "",
                 max_sequence_length: int = 300, complex_human_instruction: Optional[Sequence[str]] = None,
                 shift: Optional[float] = None, schedule: str = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1.0 (1.0 = no guidance), got {guidance_scale}")
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2 (the first token plus the prompt), "
                             f"got {max_sequence_length}")
        sched = pipe.scheduler.config
        if shift is None:
            shift = sched.get("flow_shift") or sched.get("shift") or 1.0
        flow_sigmas(1, float(shift), schedule)  # validates shift and schedule early
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor, LoRA targets, negative cache
        self.guidance_scale = float(guidance_scale)
        self.negative_prompt = str(negative_prompt)
        self.max_sequence_length = int(max_sequence_length)
        self.complex_human_instruction = (default_complex_human_instruction() if complex_human_instruction is None
                                          else list(complex_human_instruction))
        self.shift, self.schedule = float(shift), schedule
        cfg = self.transformer.config
        self.patch_size = int(cfg.patch_size)
        default_size = int(cfg.sample_size) * self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, default_size, self.vae_scale_factor * self.patch_size)
        self.latent_shape = (int(cfg.in_channels), self.height // self.vae_scale_factor,
                             self.width // self.vae_scale_factor)  # (C, h, w)
        self.timestep_scale = float(getattr(cfg, "timestep_scale", 1.0) or 1.0)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def tiny_components(cls, kind: str = "sana", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``SanaPipeline``: 2-layer ``SanaTransformer2DModel`` (patch 1), a 3-stage
        ``AutoencoderDC`` (downsampling 4, 4 latent channels), a 2-layer ``Gemma2Model`` over
        ``build_gemma_tokenizer`` (sizes as diffusers' SANA fast tests) and a flow-matching Euler
        scheduler with SANA's shift 3."""
        from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel
        from transformers import Gemma2Config, Gemma2Model

        tok = build_gemma_tokenizer()
        torch.manual_seed(seed)
        text_encoder = Gemma2Model(Gemma2Config(
            vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            max_position_embeddings=4096, sliding_window=4096))
        torch.manual_seed(seed + 1)
        vae = AutoencoderDC(
            in_channels=3, latent_channels=4, attention_head_dim=2,
            encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
            encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
            encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), downsample_block_type="conv",
            upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
            scaling_factor=0.41407)  # SANA's DC-AE scaling factor
        torch.manual_seed(seed + 2)
        transformer = SanaTransformer2DModel(
            patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=8,
            num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=32,
            sample_size=image_size // 4)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        return dict(tokenizer=tok, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str], negative: bool = False) -> dict[str, torch.Tensor]:
        chi = [] if negative else self.complex_human_instruction  # the pipeline encodes the negative without CHI
        pe, mask, _, _ = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=self.device, max_sequence_length=self.max_sequence_length,
            complex_human_instruction=chi or None)
        return {"prompt_embeds": pe, "prompt_attention_mask": mask}  # [B, L, D], [B, L] (L = max_sequence_length)

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: Gemma-2 ``prompt_embeds`` [B, max_sequence_length, D] and
        ``prompt_attention_mask`` [B, max_sequence_length]; with guidance also the cached
        ``negative_prompt_embeds`` / ``negative_prompt_attention_mask``."""
        return super().encode_prompts(prompts)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, pe: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        dtype = transformer_dtype(self.transformer)
        out = self.transformer(x.to(dtype), encoder_hidden_states=pe.to(self.device, dtype),
                               encoder_attention_mask=mask.to(self.device),
                               timestep=sigma * 1000.0 * self.timestep_scale, return_dict=False)[0]
        if out.shape[1] == 2 * x.shape[1]:  # learned sigma: keep the prediction half, as the pipeline does
            out = out[:, : x.shape[1]]
        return out  # [B, C, h, w]

    cond_keys = ("prompt_embeds", "prompt_attention_mask")  # _forward(x, sigma, *these) (base velocity)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]`` float32 from 1 to 0: ``flow_sigmas(num_steps, shift, schedule)``."""
        return flow_sigmas(num_steps, self.shift, self.schedule)
