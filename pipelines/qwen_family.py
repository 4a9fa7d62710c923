"""What Qwen-Image and Qwen-Image-Edit share (no adapter owns this module; ``pipelines/qwen_image.py`` and
``pipelines/qwen_image_edit.py`` import it): the published Qwen-Image transformer and Qwen2.5-VL configs,
Flow-GRPO's LoRA targets, the tiny random components, and :class:`QwenFamilyPolicy`, the math both
adapters run. The pieces later models built on Qwen-Image's parts share with them are functions and a mixin
here too: :class:`QwenVideoVaeFacts` (a Qwen-Image-style causal video VAE decoding one-frame videos: Qwen-Image,
Qwen-Image 2.1, Krea 2), :func:`qwen_pipeline_sigmas` (the Qwen-Image pipelines' resolution-dependent schedule,
also Qwen-Image 2.1's), :func:`pad_text` (sequence conditioning of one width with its mask) and
:func:`tiny_qwen3_vl` (a tiny random Qwen3-VL text encoder: Qwen-Image 2.1, Krea 2).

``QwenFamilyPolicy`` exposes **unpacked latents** ``[B, 16, h, w]`` (``h = H/8``), as FLUX does;
``velocity`` packs them into the MMDiT's 2x2-patch token sequence ``[B, (h/2)(w/2), 64]`` and unpacks the
prediction (``QwenImagePipeline._pack_latents`` / ``_unpack_latents``; the pipeline's frame axis of
length 1 sits between batch and channels and does not change the packed layout). The time input is
sigma itself (the pipelines pass ``timestep / 1000``). The text conditioning is Qwen2.5-VL's last
hidden state from the pipeline's own ``encode_prompt``, zero-padded to ``max_sequence_length`` with
its attention mask (batch-first conditioning of one width); the transformer call trims the padding
shared by the whole batch, and its joint attention masks the rest.

Guidance is real classifier-free guidance against ``negative_prompt`` (the pipelines'
``true_cfg_scale``; flowrl's ``guidance_scale``), followed by the norm rescale: per image token, the
combined prediction is scaled to the norm of the conditional one (``comb * |c| / |comb|`` over the
packed channel axis), as ``QwenImagePipeline.__call__``, ``QwenImageEditPlusPipeline.__call__`` and
Flow-GRPO's training forward do. flowrl runs both halves in one doubled batch
(``pipelines.common.cfg_halves``).

The schedule is the pipeline's: its scheduler (a fresh copy from the model's config) given
``linspace(1, 1/T, T)`` and ``mu`` from the generated image's packed token count; for Qwen-Image that
is the resolution-dependent exponential shift, stretched so the last sigma equals ``shift_terminal``
(0.02), then 0. Decoding adds the VAE's frame axis: ``z * latents_std + latents_mean`` per channel,
``AutoencoderKLQwenImage.decode`` on ``[B, 16, 1, h, w]``, frame 0, ``x / 2 + 0.5``.
"""
from __future__ import annotations

from typing import Annotated, Callable, Optional, Sequence, Union

import numpy as np
import torch

from flowrl.options import Between
from flowrl.schedules import flux_mu

from .base import DiffusersPolicy
from .common import Resolution, cfg_combine, cfg_halves, resolve_resolution, scheduler_sigmas
from .facts import Component, ModelConfigs
from .components import WAN21_VAE
from .packing import PackedLatents, pack_latents, unpack_latents
from .video import video_vae_decode

QwenTextTokens = Annotated[int, Between(1, 1024)]  # QwenImagePipeline's max_sequence_length limit

# Published configs of Qwen/Qwen-Image (its */config.json; flowrl plan and bench precision build the models from them
# on the meta device or with random weights, no download). transformer/config.json (QwenImageTransformer2DModel:
# 60 double-stream blocks, 24 heads of 128 = 3072 wide, Qwen2.5-VL captions of 3584; as quoted by diffusers' own
# __init__ defaults and third-party readers of the repository, e.g. musubi-tuner's qwen_image_model.py)
QWEN_IMAGE_20B = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                      axes_dims_rope=(16, 56, 56))
# text_encoder/config.json: Qwen/Qwen2.5-VL-7B-Instruct as Qwen2_5_VLForConditionalGeneration (the language model,
# its lm_head and the 32-block vision tower; as copied in modelscope/DiffSynth-Studio's qwen_image_text_encoder.py
# and VideoX-Fun's Qwen-Image loader)
QWEN25_VL_7B = dict(
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=128000,
                     max_window_layers=28, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
                     sliding_window=32768, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645,
                     rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3,
                       out_hidden_size=3584, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", tokens_per_second=2),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False)
# vae/config.json (AutoencoderKLQwenImage) holds Wan2.1's VAE values (WAN21_VAE): base_dim 96,
# dim_mult [1, 2, 4, 4], temporal downsampling [False, True, True], 16 channels and the same latent mean / std
QWEN_IMAGE_VAE = Component("diffusers:AutoencoderKLQwenImage", WAN21_VAE)
QWEN_TEXT_ENCODERS = {"text_encoder": Component("transformers:Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B)}

# Flow-GRPO's LoRA targets for Qwen-Image (scripts/train_qwenimage_edit_plus.py: r=64, alpha=128, gaussian
# init): the joint attention's projections of both streams and both streams' feed-forwards.
QWEN_IMAGE_LORA_TARGET_MODULES = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)  # a loaded policy's own list leaves out the last block's unused text-stream outputs (live_lora_targets)

# the last block's text stream feeds nothing (the model returns the image stream): LoRA there gets no gradient
LAST_BLOCK_UNUSED = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def live_lora_targets(num_blocks: int, targets) -> list[str]:
    """``targets`` (peft suffix patterns) without the modules of the last of ``num_blocks`` blocks
    in ``LAST_BLOCK_UNUSED``: each such suffix becomes the explicit names of the other blocks'
    modules (``transformer_blocks.{i}.<suffix>``). The last block's text stream produces nothing
    the model returns, so a LoRA there would never get a gradient (and DDP refuses parameters
    without one)."""
    out: list[str] = []
    for t in targets:
        out += [f"transformer_blocks.{i}.{t}" for i in range(num_blocks - 1)] if t in LAST_BLOCK_UNUSED else [t]
    return out


def tiny_qwen25_vl(tok, num_layers: int, seed: int = 0):
    """A random ``Qwen2_5_VLForConditionalGeneration`` with ``num_layers`` language layers 16 wide and a 1-block
    vision tower (patch 14, 2x2 merge, as the real one) over the offline tokenizer ``tok``
    (``pipelines.tiny.build_qwen_tokenizer``), its special tokens' ids from ``tok``; drawn after
    ``torch.manual_seed(seed)``. Sizes as diffusers' Qwen-Image fast tests."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in
           ("image_pad", "video_pad", "vision_start", "vision_end", "endoftext", "im_end")}
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": num_layers,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tok), "rope_theta": 1e6,
                     "bos_token_id": ids["endoftext"], "eos_token_id": ids["im_end"],
                     "pad_token_id": ids["endoftext"],
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": 16},
        vocab_size=len(tok), image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])).eval()
    return text_encoder


def tiny_qwen_components(tok, seed: int = 0, **transformer_options) -> dict:
    """Tiny random Qwen-Image components over the offline tokenizer ``tok`` (``pipelines.tiny.
    build_qwen_tokenizer``): a 2-layer ``QwenImageTransformer2DModel`` (patch 2, 64 packed channels, as
    the real model; ``transformer_options`` such as ``zero_cond_t=True`` added), an
    ``AutoencoderKLQwenImage`` with Qwen-Image's layout (16 latent channels, spatial factor 8, causal 3D
    convolutions, its latent mean / std) at width 8, a 2-layer ``Qwen2_5_VLForConditionalGeneration``
    (hidden 16, a 1-block vision tower: patch 14, 2x2 merge, as the real one) and Qwen-Image's scheduler
    config (dynamic exponential shift 0.5 -> 0.9 over 256 -> 8192 tokens, shift_terminal 0.02).
    Transformer and text encoder sizes as diffusers' Qwen-Image fast tests."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    text_encoder = tiny_qwen25_vl(tok, num_layers=2, seed=seed)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])  # default latents_mean / std
    torch.manual_seed(seed + 2)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4), **transformer_options)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer)


class QwenVideoVaeFacts:
    """Model facts of an adapter whose VAE is a Qwen-Image-style causal video VAE (``AutoencoderKLQwenImage``,
    ``AutoencoderKLQwenImage21``) that decodes its images as one-frame videos."""

    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        """The causal video VAE: 2 per downsampling stage (one ``temperal_downsample`` entry each: 8 for
        Qwen-Image's, 16 for Qwen-Image 2.1's)."""
        return 2 ** len(configs.vae.config["temperal_downsample"])

    @classmethod
    def vae_latents(cls, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> ``[B, C, 1, h, w]``: the video VAE decodes a one-frame video."""
        return latents[:, :, None]


def qwen_pipeline_sigmas(scheduler, image_seq_len: int, num_steps: int,
                         grid: Optional[Sequence[float]] = None) -> torch.Tensor:
    """``[num_steps + 1]`` float32: the sigmas the Qwen-Image pipelines (``QwenImagePipeline``,
    ``QwenImageEditPlusPipeline``, ``QwenImage21Pipeline``) give their scheduler, ``linspace(1, 1/T, T)`` (or
    ``grid``, the ``T`` sigmas a pipeline config fixes) with ``mu`` linear in the image's token count
    ``image_seq_len`` (their ``calculate_shift``, the config's ``base_image_seq_len`` / ``max_image_seq_len`` /
    ``base_shift`` / ``max_shift`` with the same fallbacks), run through a fresh copy of ``scheduler``."""
    cfg = scheduler.config
    mu = flux_mu(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                 cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))  # the pipelines' calculate_shift
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps) if grid is None else np.asarray(grid, dtype=np.float64)
    return scheduler_sigmas(scheduler, sigmas, mu)


def pad_text(pe: torch.Tensor, mask: Optional[torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A text encoding ``pe`` ``[B, n, D]`` with its mask ``[B, n]`` (1 = token; None: every token) zero-padded to
    ``length >= n`` tokens: ``{"prompt_embeds": [B, length, D], "prompt_embeds_mask": [B, length]}``."""
    b, n, d = pe.shape
    if mask is None:  # the pipelines drop an all-ones mask
        mask = torch.ones(b, n, dtype=torch.long, device=pe.device)
    pad = length - n
    pe = torch.cat([pe, pe.new_zeros(b, pad, d)], 1)  # [B, L, D]
    mask = torch.cat([mask, mask.new_zeros(b, pad)], 1)  # [B, L]
    return {"prompt_embeds": pe, "prompt_embeds_mask": mask}


def tiny_qwen3_vl(model_class: str, tok, num_layers: int, *, tie_word_embeddings: bool, hidden: int = 16):
    """A tiny random Qwen3-VL text encoder over the offline tokenizer ``tok`` (``pipelines.tiny.
    build_qwen_tokenizer``): ``model_class`` ``"Qwen3VLForConditionalGeneration"`` (Qwen-Image 2.1) or
    ``"Qwen3VLModel"`` (Krea 2), a text model of ``num_layers`` layers ``hidden`` wide (2 query / 1 KV heads of 8,
    the published interleaved 3-axis M-RoPE with theta 5e6, sections 1 / 1 / 2 of the 4 rotary pairs) and a 1-block
    vision tower (patch 16, 2x2 merge, temporal patch 2, as the published one); random weights in eval mode."""
    import transformers

    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in
           ("image_pad", "video_pad", "vision_start", "vision_end", "endoftext", "im_end")}
    config = transformers.Qwen3VLConfig(
        text_config={"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": num_layers,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": len(tok),
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [1, 1, 2],
                                         "mrope_interleaved": True},
                     "bos_token_id": ids["endoftext"], "eos_token_id": ids["im_end"], "pad_token_id": ids["endoftext"]},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": hidden, "patch_size": 16, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=tie_word_embeddings)
    return getattr(transformers, model_class)(config).eval()


class QwenFamilyPolicy(QwenVideoVaeFacts, PackedLatents, DiffusersPolicy):
    """The math Qwen-Image and Qwen-Image-Edit share (module doc); an adapter subclasses it with its
    declarations (``kind``, ``pipeline_class``, ``published``, ...) and calls :meth:`_setup_qwen`."""

    transformer_class = "QwenImageTransformer2DModel"
    lora_target_modules = QWEN_IMAGE_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")  # _forward(x, sigma, *these) (base)

    def _setup_qwen(self, pipe, *, guidance_scale: float, negative_prompt: str, max_sequence_length: int,
                    shift: Optional[float], schedule: str, resolution: Resolution,
                    device: Union[str, torch.device], **own) -> None:
        """The checks and set-up of both adapters' ``__init__`` (their docstrings name the arguments; ``own``:
        an adapter's further options, checked and kept by ``_keep_options``). ``guidance_scale`` is the
        pipeline's ``true_cfg_scale``; ``max_sequence_length`` at most 1024, the pipeline's limit."""
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule, **own)
        if pipe.transformer.config.guidance_embeds:
            raise ValueError("this Qwen-Image transformer is guidance-distilled (guidance_embeds=True), which "
                             "QwenImagePolicy does not support; use a model with guidance_embeds=False")
        if pipe.scheduler.config.get("invert_sigmas") and shift is None:
            raise ValueError("QwenImagePolicy's schedule runs from 1 to 0; this scheduler inverts its sigmas "
                             "(invert_sigmas=True): pass shift= to use flowrl's static-shift schedule instead")
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor, LoRA targets, negative cache
        f = self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, int(pipe.default_sample_size) * f, 2 * f)
        h, w = self.height // f, self.width // f
        self.latent_shape = (int(self.transformer.config.in_channels) // 4, h, w)  # (C, h, w), unpacked
        self.image_seq_len = (h // 2) * (w // 2)  # packed tokens per image
        self.lora_target_modules = live_lora_targets(len(self.transformer.transformer_blocks),
                                                     self.lora_target_modules)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL embeddings ``[rows, L, joint_attention_dim]`` and their int64 mask ``[rows, L]``."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["joint_attention_dim"],
                                             device=device, dtype=dtype),  # [B, L, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device,
                                                  dtype=torch.int64)}  # [B, L]

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, token_multiple: int = 1, **settings) -> dict:
        """Unpacked latents ``[B, C, h, w]`` packed to ``[B, (h/2)(w/2), 4C]`` with their grid
        (``img_shapes``, one frame), ``timestep = sigma``; the text trimmed to the batch's longest
        prompt (rounded up to a multiple of ``token_multiple``, the context-parallel degree, with the
        extra tokens masked), its mask dropped when nothing is padded (module doc). Meta tensors (the
        planner's shapes) keep every token, unmasked."""
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"Qwen-Image latents need even height and width (2x2 packing), got {tuple(x.shape)}")
        pe, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]  # [B, L, D], [B, L]
        if mask.device.type == "meta":
            mask = None
        else:
            keep = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1  # the batch's longest prompt
            keep = min(-(-keep // token_multiple) * token_multiple, mask.shape[1])
            pe, mask = pe[:, :keep], mask[:, :keep]  # [B, keep, D], [B, keep]
            mask = None if bool(mask.all()) else mask.to(x.device)
        return dict(hidden_states=pack_latents(x).to(dtype), timestep=sigma,  # [B, (h/2)(w/2), 4C]
                    encoder_hidden_states=pe.to(x.device, dtype), encoder_hidden_states_mask=mask,
                    img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)

    @classmethod
    def transformer_output(cls, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The generated image's tokens (the first ``(h/2)(w/2)``; an editing model appends its sources'
        after them) unpacked to ``[B, C, h, w]``."""
        h, w = x.shape[-2:]
        return unpack_latents(out[:, :(h // 2) * (w // 2)], h, w)  # [B, C, h, w]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return dict(patch_size=transformer["patch_size"], in_channels=transformer["in_channels"],
                    out_channels=transformer["out_channels"], num_layers=2, attention_head_dim=16,
                    num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))

    # --- FlowPolicy ----------------------------------------------------------------------
    def forward_settings(self) -> dict:
        """The context-parallel degree the text is trimmed to a multiple of (``transformer_inputs``)."""
        return {"token_multiple": self.token_multiple}

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, mask = self.pipe.encode_prompt(prompts, device=self.device, max_sequence_length=self.max_sequence_length)
        return self._padded(pe, mask)

    def _padded(self, pe: torch.Tensor, mask: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``encode_prompt``'s ``(prompt_embeds [B, n, D], mask [B, n] or None)`` zero-padded to
        ``max_sequence_length``: ``{"prompt_embeds": [B, L, D], "prompt_embeds_mask": [B, L]}`` (1 = token)."""
        n = pe.shape[1]  # the batch's longest prompt
        if n > self.max_sequence_length:
            raise ValueError(f"a prompt encodes to {n} tokens, more than max_sequence_length="
                             f"{self.max_sequence_length}; raise model.options.max_sequence_length (at most 1024)")
        return pad_text(pe, mask, self.max_sequence_length)

    def velocity(self, latents: torch.Tensor, sigma, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 ``[B, C, h, w]`` for unpacked latents; ``sigma`` in [0, 1].

        Differentiable in the transformer's parameters; with guidance, ``u + s (c - u)`` rescaled
        per packed token to ``|c|`` (module doc; ``cfg_halves`` / ``cfg_combine`` for training).
        """
        x = latents.to(self.device)  # [B, C, h, w]
        if x.shape[0] == 0:  # no rows (an update's empty minibatch): the transformer's RoPE needs a first row
            return x.float()  # [0, C, h, w]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(x.shape[0])  # [B]
        negative = [cond["negative_" + k] for k in self.cond_keys] if self.guidance_scale != 1.0 else []
        return self._guided(self._forward, x, sigma, [cond[k] for k in self.cond_keys], negative)

    def _guided(self, forward: Callable[..., torch.Tensor], x: torch.Tensor, sigma: torch.Tensor,
                text: Sequence[torch.Tensor], negative: Sequence[torch.Tensor]) -> torch.Tensor:
        """``forward(x, sigma, *entries)`` under the text's entries, or guided with the negative ones and
        the norm rescale (module doc) -> float32 ``[B, C, h, w]``."""
        if self.guidance_scale == 1.0:
            return forward(x, sigma, *text).float()  # [B, C, h, w]
        h, w = x.shape[-2:]
        u, c = cfg_halves(forward, (x, sigma, *negative), (x, sigma, *text),
                          uncond_grad=self.cfg_uncond_grad)  # [B, C, h, w] each
        comb = pack_latents(cfg_combine(u, c, self.guidance_scale, uncond_grad=self.cfg_uncond_grad))  # [B, (h/2)(w/2), 4C]
        c = pack_latents(c)  # [B, (h/2)(w/2), 4C]
        comb = comb * (c.float().norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))  # the norm rescale
        return unpack_latents(comb, h, w)  # [B, C, h, w]

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas the pipeline gives its scheduler at this resolution (module doc)."""
        return qwen_pipeline_sigmas(self.pipe.scheduler, self.image_seq_len, num_steps)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> float32 images ``[B, 3, 8h, 8w]`` in [0, 1] through the video
        VAE with one frame (module doc); ``decode_batch`` images per VAE call."""
        video = video_vae_decode(self.vae, self.vae_latents(latents), self.device, self.decode_batch)  # [B, 3, 1, H, W]
        return video[:, :, 0]  # [B, 3, H, W]


__all__ = ["LAST_BLOCK_UNUSED", "QwenTextTokens", "QWEN25_VL_7B", "QWEN_IMAGE_20B", "QWEN_IMAGE_LORA_TARGET_MODULES", "QWEN_IMAGE_VAE",
           "QWEN_TEXT_ENCODERS", "QwenFamilyPolicy", "QwenVideoVaeFacts", "live_lora_targets", "pad_text",
           "qwen_pipeline_sigmas", "tiny_qwen25_vl", "tiny_qwen3_vl", "tiny_qwen_components"]
