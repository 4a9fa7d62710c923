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
from typing import Annotated, Optional, Sequence, Union

import torch

from flowrl.options import AtLeast, Guidance

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import Resolution, Schedule, Shift, resolve_resolution
from .facts import Component, ModelConfigs

# Sol-RL's SANA LoRA targets (NVlabs/Sana configs/sol_rl/sana.py: attn.qkv, attn.proj, cross_attn.q_linear,
# cross_attn.kv_linear, cross_attn.proj), in diffusers' module names: self-attention attn1 and
# cross-attention attn2, query / key / value and output projections.
SANA_LORA_TARGET_MODULES = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
)

# Published configs of Efficient-Large-Model/Sana_1600M_1024px_diffusers (its */config.json): transformer/ is
# SanaMS_1600M_P1_D20 as diffusers' convert_sana_to_diffusers.py writes it (20 blocks, 70 heads of 32 = 2240 wide,
# cross-attention 20 heads of 112, Gemma-2 captions of 2304); text_encoder/ is google/gemma-2-2b-it's decoder
# (Gemma2Model); vae/ is mit-han-lab/dc-ae-f32c32-sana-1.0 (AutoencoderDC: 32x downsampling, 32 channels)
SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                  num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                  caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
                  norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None)
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_act="gelu_pytorch_tanh",
                 max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                 query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                 attn_logit_softcapping=50.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
DC_AE_F32C32 = dict(in_channels=3, latent_channels=32, attention_head_dim=32,
                    encoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
                    decoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
                    encoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
                    decoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
                    encoder_layers_per_block=[2, 2, 2, 3, 3, 3], decoder_layers_per_block=[3, 3, 3, 3, 3, 3],
                    encoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
                    decoder_qkv_multiscales=[[], [], [], [5], [5], [5]], upsample_block_type="interpolate",
                    downsample_block_type="Conv", decoder_norm_types="rms_norm", decoder_act_fns="silu",
                    scaling_factor=0.41407)

SanaTextTokens = Annotated[int, AtLeast(2)]  # Gemma's first token plus the prompt


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
    cond_keys = ("prompt_embeds", "prompt_attention_mask")  # _forward(x, sigma, *these) (base velocity)
    published = {example_hub_id: ModelConfigs(
        SANA_1600M, {"text_encoder": Component("transformers:Gemma2Model", GEMMA2_2B)},
        Component("diffusers:AutoencoderDC", DC_AE_F32C32), example_hub_id, "SANA-1600M", "sana-arch")}

    def __init__(self, pipe, *, guidance_scale: Guidance = 4.5, negative_prompt: str = "",
                 max_sequence_length: SanaTextTokens = 300, complex_human_instruction: Optional[Sequence[str]] = None,
                 shift: Shift = None, schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        sched = pipe.scheduler.config
        if shift is None:
            shift = sched.get("flow_shift") or sched.get("shift") or 1.0
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=float(shift), schedule=schedule,
                           complex_human_instruction=(default_complex_human_instruction()
                                                      if complex_human_instruction is None
                                                      else list(complex_human_instruction)))
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor, LoRA targets, negative cache
        cfg = self.transformer.config
        self.patch_size = int(cfg.patch_size)
        default_size = int(cfg.sample_size) * self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, default_size, self.vae_scale_factor * self.patch_size)
        self.latent_shape = (int(cfg.in_channels), self.height // self.vae_scale_factor,
                             self.width // self.vae_scale_factor)  # (C, h, w)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        """DC-AE: 2 per encoder stage after the first (32 for the 6-stage f32c32)."""
        return 2 ** (len(configs.vae.config["encoder_block_out_channels"]) - 1)

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Gemma-2 embeddings ``[rows, L, caption_channels]`` and their int64 attention mask ``[rows, L]``."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["caption_channels"],
                                             device=device, dtype=dtype),  # [B, L, D]
                "prompt_attention_mask": torch.empty(rows, geometry.text_tokens, device=device,
                                                     dtype=torch.int64)}  # [B, L]

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """``timestep = sigma * 1000 * timestep_scale``; the Gemma-2 embeddings with their attention mask."""
        scale = float(config.get("timestep_scale", 1.0) or 1.0)
        return dict(hidden_states=x.to(dtype), encoder_hidden_states=cond["prompt_embeds"].to(x.device, dtype),
                    encoder_attention_mask=cond["prompt_attention_mask"].to(x.device),
                    timestep=sigma * 1000.0 * scale, return_dict=False)

    @classmethod
    def transformer_output(cls, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A learned-sigma model returns twice the channels: the prediction is the first half, as the pipeline keeps."""
        return out[:, : x.shape[1]] if out.shape[1] == 2 * x.shape[1] else out  # [B, C, h, w]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return dict(in_channels=transformer["in_channels"], out_channels=transformer["out_channels"], num_layers=2,
                    num_attention_heads=2, attention_head_dim=8, num_cross_attention_heads=2,
                    cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16, sample_size=32,
                    patch_size=transformer["patch_size"])

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
