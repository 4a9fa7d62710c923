"""ERNIE-Image and ERNIE-Image-Turbo (Baidu, 8B) as a ``FlowPolicy``, over diffusers ``ErnieImagePipeline``.

**Model.** ``ErnieImageTransformer2DModel`` is a single-stream DiT: 36 blocks of shared-AdaLN self-attention over
the image tokens followed by the text tokens, RMS-normed queries and keys, 3-axis RoPE (image tokens
``(text length, row, col)``, text tokens ``(l, 0, 0)``) and a gated-GELU MLP. It runs on the VAE's latents
**already patchified**: the FLUX.2 VAE (``AutoencoderKLFlux2``: 32 channels, factor 8) seen through its 2x2
patchify, so flowrl's latents are the pipeline's own, ``[B, 128, H/16, W/16]``, in the VAE's batch-norm space.
``decode`` denormalizes with the batch-norm statistics, unpatchifies (``flux2_family.unpatchify``) and decodes,
as ``ErnieImagePipeline.__call__`` does (its denormalization uses eps ``1e-5``, the trained value, not the VAE
config's ``batch_norm_eps``: the pipeline's comment says the hub config still differs).

**Conventions** (``ErnieImagePipeline.__call__``). The time input is the scheduler's timestep ``1000 sigma`` in the
transformer's dtype; the model predicts the velocity itself. Guidance is real classifier-free guidance
``u + s (c - u)`` against ``negative_prompt`` (the pipeline's default ``""``), on when ``guidance_scale`` > 1; the
pipeline runs both halves as one doubled batch (unconditional first), as flowrl does, so the two agree bit for
bit. ERNIE-Image samples in 50 steps at guidance 4.0; ERNIE-Image-Turbo, its distilled variant, in 8 steps without
guidance (the diffusers documentation's settings). Neither transformer has a guidance embedding: Turbo's
distilled guidance needs no input, and 1.0 (no CFG) is its setting.

**Text.** The pipeline's own ``encode_prompt``: each prompt tokenized alone (the tokenizer's special tokens, no
chat template), the text encoder's (Ministral 3 3B as a ``Mistral3Model``) second-to-last hidden state, each
prompt's own length. flowrl pads them to ``max_sequence_length`` with an int64 mask (batch-first conditioning of
one width; a longer prompt is cut there, where the pipeline keeps up to the tokenizer's own limit);
``transformer_inputs`` hands the transformer the rows cut to the batch's longest prompt and each row's length
(``text_lens``), which is what the pipeline's ``_pad_text`` gives it. The pipeline's optional prompt enhancer
(``pe``, a 3B language model that rewrites each prompt by sampling) is never loaded or used: a rollout must be
scored against the prompt it was given.

**Schedule.** The pipeline's: ``linspace(1, 0, T + 1)[:-1]`` through the scheduler. ERNIE-Image's scheduler is
static (shift 4.0, ``use_dynamic_shifting: false``).
"""
from __future__ import annotations

import functools
from typing import Union

import torch

from flowrl.options import Guidance

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import (DECODE_BATCH, Resolution, Schedule, Shift, TextTokens, check_scheduler, module_dtype,
                     resolve_resolution, scheduler_sigmas)
from .facts import Component, ModelConfigs
from .flux2_family import FLUX2_VAE, unpatchify

# No peer publishes LoRA targets for ERNIE-Image: every block's attention projections and its MLP (the layers
# Flow-Factory's default targets cover for the single-stream Z-Image, r=64, alpha=128)
ERNIE_IMAGE_LORA_TARGET_MODULES = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v",
                                   "self_attention.to_out.0", "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")
# Published configs. baidu/ERNIE-Image transformer/config.json (as copied with the repository, e.g. the hub's
# "Duplicate from baidu/ERNIE-Image" copies; ERNIE-Image-Turbo's is the same architecture): 36 blocks 4096 wide,
# 32 heads, MLP 12288, 128 patchified latent channels, patch 1, text features 3072, RoPE (32, 48, 48), theta 256
ERNIE_IMAGE_8B = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
                      out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48),
                      eps=1e-6, qk_layernorm=True)
# text_encoder/config.json: Ministral 3 3B as a Mistral3Model. text_config as the repositories' copy of it reads
# (26 layers 3072 wide, 32 query / 8 KV heads of 128, MLP 9216, vocabulary 131072); its vision_config is not in
# the copies found: assumed the Pixtral tower of the Mistral 3 family (24 layers 1024 wide, patch 14), which
# flowrl never runs (about 0.4B of the encoder's parameters, counted by flowrl plan)
MINISTRAL3_3B = dict(
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=3072, intermediate_size=9216,
                     num_hidden_layers=26, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-5, rope_theta=1e6,
                     sliding_window=None, tie_word_embeddings=True),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, patch_size=14, image_size=1540, hidden_act="silu"),
    image_token_index=10, projector_hidden_act="gelu", multimodal_projector_bias=False, spatial_merge_size=2,
    vision_feature_layer=-1)
# vae/config.json: an AutoencoderKLFlux2 (model_index.json); its values are not in the copies found: assumed FLUX.2's
# (flux2_family.FLUX2_VAE), the layout the pipeline's patchify and 16x factor assume
SCHEDULER_SHIFT = 4.0  # baidu/ERNIE-Image scheduler/scheduler_config.json: static shift 4.0
BATCH_NORM_EPS = 1e-5  # ErnieImagePipeline.__call__'s denormalization eps (the trained value)
TINY_TEXT_WORDS = ("photo", "cat", "red", "apple", "table")  # whole tokens of the tiny tokenizer (the test prompts)


def ernie_vae_decode(vae, latents: torch.Tensor, device, batch=DECODE_BATCH) -> torch.Tensor:
    """Patchified normalized latents ``[B, 128, h, w]`` -> float32 images ``[B, 3, 16h, 16w]`` in [0, 1], as
    ``ErnieImagePipeline.__call__`` decodes: ``z sqrt(bn.running_var + 1e-5) + bn.running_mean`` per channel,
    unpatchify to ``[B, 32, 2h, 2w]``, VAE decode, ``x / 2 + 0.5`` clamped. ``batch`` images per VAE call."""
    dtype = module_dtype(vae)
    step = batch or max(1, len(latents))
    out = []
    for i in range(0, len(latents), step):
        z = latents[i:i + step].to(device, dtype)  # [b, 128, h, w]
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + BATCH_NORM_EPS).to(z.device, z.dtype)
        with torch.no_grad():
            img = vae.decode(unpatchify(z * std + mean), return_dict=False)[0]  # [b, 3, H, W] in ~[-1, 1]
        out.append((img.float() / 2 + 0.5).clamp(0, 1))
    return torch.cat(out)  # [B, 3, H, W]


@functools.lru_cache(maxsize=None)
def meta_safe_transformer_class() -> type:
    """``ErnieImageTransformer2DModel`` whose RoPE also runs on the meta device (what ``flowrl plan`` and the
    architecture benchmark build, :meth:`ErnieImagePolicy.transformer_component`; the module attribute
    ``MetaSafeErnieImageTransformer2DModel``, built on first use): diffusers' ``rope`` opens
    ``torch.autocast(device_type=ids.device.type, enabled=False)``, which torch refuses for ``"meta"``; on meta
    inputs the embedding is computed without it, to the same shape and dtype (its values do not exist there). On
    any other device it is the model's own."""
    from diffusers import ErnieImageTransformer2DModel
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageEmbedND3

    class MetaSafeEmbedND3(ErnieImageEmbedND3):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if ids.device.type != "meta":
                return super().forward(ids)
            emb = torch.cat([ids[..., i, None].float() * torch.ones(d // 2, device=ids.device)
                             for i, d in enumerate(self.axes_dim)], dim=-1).unsqueeze(2)  # [B, S, 1, head_dim / 2]
            return torch.stack([emb, emb], dim=-1).reshape(*emb.shape[:-1], -1)  # [B, S, 1, head_dim]

    class MetaSafeErnieImageTransformer2DModel(ErnieImageTransformer2DModel):
        def __init__(self, **config):
            super().__init__(**config)
            self.pos_embed.__class__ = MetaSafeEmbedND3

    # the model's own name in messages (flowrl plan's, e.g. "... declares no context-parallel plan")
    MetaSafeErnieImageTransformer2DModel.__name__ = ErnieImageTransformer2DModel.__name__
    return MetaSafeErnieImageTransformer2DModel


def __getattr__(name: str):
    """``MetaSafeErnieImageTransformer2DModel`` (a ``Component`` class name), built on first use without importing
    diffusers when the adapter module loads."""
    if name == "MetaSafeErnieImageTransformer2DModel":
        return meta_safe_transformer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_ministral_tokenizer():
    """An offline byte-level BPE ``PreTrainedTokenizerFast`` for tiny models: whole-word tokens
    (``pipelines.tiny.byte_level_vocab``), Mistral's ``<s>`` / ``</s>`` / ``<unk>`` / ``<pad>``, and ``<s>``
    prepended when ``add_special_tokens`` (what ``ErnieImagePipeline.encode_prompt`` asks of the real one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from .tiny import byte_level_vocab

    vocab, merges = byte_level_vocab(TINY_TEXT_WORDS)
    for s in ("<unk>", "<s>", "</s>", "<pad>"):
        vocab[s] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=131072)


class ErnieImagePolicy(DiffusersPolicy):
    """``FlowPolicy`` for ERNIE-Image / ERNIE-Image-Turbo (see module doc).

    Args:
        pipe: a loaded ``ErnieImagePipeline`` (its components are used, not its loop).
        guidance_scale: the CFG scale of ``u + s (c - u)`` against ``negative_prompt``, 1.0 = none (one pass);
            the pipeline's default 4.0 (ERNIE-Image), 1.0 for ERNIE-Image-Turbo.
        negative_prompt: the unconditional prompt (the pipeline's default ``""``).
        max_sequence_length: text tokens at most per prompt (padded to it; the pipeline has no limit below the
            tokenizer's).
        shift: None (default) = the pipeline's schedule; a float replaces it by ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels (multiples of 16), int or (H, W); None = ``flowrl.json``'s, else the
            pipeline's 1024.
        device: where the models and all returned tensors live.
    """

    kind = "ernie-image"
    pipeline_class = "ErnieImagePipeline"
    transformer_class = "ErnieImageTransformer2DModel"
    lora_target_modules = ERNIE_IMAGE_LORA_TARGET_MODULES
    # the frozen language models the pipeline holds: the text encoder and the optional prompt enhancer ("pe",
    # never loaded by from_pretrained; a text-embedding cache drops the text encoder)
    text_encoder_names = ("text_encoder", "pe")
    tiny_kinds = ("ernie-image",)
    example_hub_id = "baidu/ERNIE-Image"
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")  # _forward(x, sigma, *these) (base velocity)
    published = {hub: ModelConfigs(ERNIE_IMAGE_8B, {"text_encoder": Component("transformers:Mistral3Model",
                                                                                MINISTRAL3_3B)},
                                   Component("diffusers:AutoencoderKLFlux2", FLUX2_VAE), hub, title, "ernie-image-arch")
                 for hub, title in (("baidu/ERNIE-Image", "ERNIE-Image"),
                                    ("baidu/ERNIE-Image-Turbo", "ERNIE-Image-Turbo"))}

    @classmethod
    @functools.wraps(DiffusersPolicy.from_pretrained.__func__)
    def from_pretrained(cls, path_or_id, **kwargs):
        """``DiffusersPolicy.from_pretrained`` without the prompt enhancer (``pe=None``: not loaded)."""
        kwargs.setdefault("pe", None)
        return super().from_pretrained(path_or_id, **kwargs)

    def __init__(self, pipe, *, guidance_scale: Guidance = 4.0, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 512, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule)
        check_scheduler("ErnieImagePolicy", pipe.scheduler.config, shift, schedule)
        if pipe.scheduler.config.get("use_dynamic_shifting") and shift is None:
            raise ValueError("ErnieImagePolicy: the scheduler shifts dynamically, which ErnieImagePipeline cannot run "
                             "(it passes no mu); use a static-shift scheduler or pass shift=")
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor (16), LoRA targets, negative cache
        f = self.vae_scale_factor  # 2 ** len(block_out_channels): the VAE's 8 x the 2x2 patchify
        self.height, self.width = resolve_resolution(resolution, 1024, f)
        self.latent_shape = (int(self.transformer.config.in_channels), self.height // f, self.width // f)

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        """Pixels per latent pixel: the VAE's factor times the 2x2 patchify (``2 ** len(block_out_channels)``)."""
        return 2 ** len(configs.vae.config["block_out_channels"])

    @classmethod
    def default_resolution(cls, configs: ModelConfigs) -> int:
        return 1024  # ErnieImagePipeline's default height / width

    @classmethod
    def vae_latents(cls, latents: torch.Tensor) -> torch.Tensor:
        """The patchified latents ``[B, 128, h, w]`` as the VAE decodes them, ``[B, 32, 2h, 2w]``."""
        return unpatchify(latents)

    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """The published transformer as ``flowrl plan`` and the architecture benchmark build it: the model's own
        class with a RoPE that also runs on the meta device (:func:`meta_safe_transformer_class`)."""
        return Component(f"{__name__}:MetaSafeErnieImageTransformer2DModel", transformer)

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Text features ``[rows, L, text_in_dim]`` and their int64 mask ``[rows, L]``."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["text_in_dim"],
                                             device=device, dtype=dtype),  # [B, L, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.int64)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Latents ``[B, 128, h, w]`` as they are, time ``1000 sigma`` in the model's dtype, the text cut to the
        batch's longest prompt ``[B, T, D]`` with each row's length ``text_lens`` [B] (meta tensors, the planner's
        shapes, keep all L)."""
        pe, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]  # [B, L, D], [B, L]
        if mask.device.type == "meta":
            lens = torch.full((pe.shape[0],), pe.shape[1], dtype=torch.int64, device=x.device)
        else:
            lens = mask.sum(1).to(x.device)  # [B]
            pe = pe[:, :max(int(lens.max()), 1)]  # [B, T, D]
        return dict(hidden_states=x.to(dtype), timestep=(sigma * 1000.0).to(dtype),
                    text_bth=pe.to(x.device, dtype), text_lens=lens, return_dict=False)

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "hidden_size": 32, "num_attention_heads": 2, "num_layers": 2, "ffn_hidden_size": 64,
                "text_in_dim": 16, "rope_axes_dim": (8, 4, 4)}

    @classmethod
    def tiny_components(cls, kind: str = "ernie-image", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``ErnieImagePipeline``: the published transformer shrunk (:meth:`shrink_config`: 2 blocks 32 wide,
        2 heads of 16, RoPE (8, 4, 4), text features 16; its zero-initialised modulation and output layers given
        small random weights, so the tiny model's velocity is not identically zero), a ``Mistral3Model`` of 2 text
        layers 16 wide and a 1-layer Pixtral tower over :func:`build_ministral_tokenizer`, an ``AutoencoderKLFlux2``
        with FLUX.2's layout (32 channels, factor 8; the pipeline's patchify makes it 128 and 16) at width 8 with
        random batch-norm statistics (so decoding checks the denormalization), ERNIE-Image's scheduler (static
        shift 4.0), and no prompt enhancer."""
        from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler
        from transformers import Mistral3Config, Mistral3Model

        tok = build_ministral_tokenizer()
        torch.manual_seed(seed)
        text_encoder = Mistral3Model(Mistral3Config(
            text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             max_position_embeddings=2048, rope_theta=1e6, sliding_window=None,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id),
            vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=8, patch_size=14, image_size=56),
            image_token_index=tok.unk_token_id, spatial_merge_size=2)).eval()
        torch.manual_seed(seed + 1)
        transformer = ErnieImageTransformer2DModel(**cls.shrink_config(ERNIE_IMAGE_8B))
        with torch.no_grad():  # the model zero-initialises these two (a trained model has them non-zero)
            for layer in (transformer.adaLN_modulation[-1], transformer.final_linear):
                layer.weight.normal_(0.0, 0.05)
                layer.bias.normal_(0.0, 0.05)
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=32,
                                 norm_num_groups=4, sample_size=image_size)
        g = torch.Generator().manual_seed(seed + 3)
        with torch.no_grad():
            vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=g))
            vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(vae.bn.running_var.shape, generator=g))
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT,
                                                    use_dynamic_shifting=False)
        return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tok, scheduler=scheduler,
                    pe=None, pe_tokenizer=None)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds = self.pipe.encode_prompt(list(prompts), self.device)  # [n_i, D] each
        n, d = self.max_sequence_length, embeds[0].shape[-1]
        pe = torch.zeros(len(embeds), n, d, dtype=embeds[0].dtype, device=self.device)  # [B, L, D]
        mask = torch.zeros(len(embeds), n, dtype=torch.long, device=self.device)  # [B, L]
        for i, e in enumerate(embeds):
            k = min(len(e), n)
            pe[i, :k], mask[i, :k] = e[:k], 1
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask}

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: ``prompt_embeds`` [B, max_sequence_length, D] (each prompt's tokens, zero
        padded) and ``prompt_embeds_mask`` [B, max_sequence_length]; with guidance also the cached
        ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``."""
        return super().encode_prompts(prompts)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas ``ErnieImagePipeline`` gives its scheduler: ``linspace(1, 0, T + 1)[:-1]``."""
        return scheduler_sigmas(self.pipe.scheduler, torch.linspace(1.0, 0.0, num_steps + 1)[:-1].numpy())

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 128, h, w]`` -> float32 images ``[B, 3, 16h, 16w]`` in [0, 1] (:func:`ernie_vae_decode`)."""
        return ernie_vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, H, W]


__all__ = ["ERNIE_IMAGE_8B", "ERNIE_IMAGE_LORA_TARGET_MODULES", "MINISTRAL3_3B", "ErnieImagePolicy",
           "build_ministral_tokenizer", "ernie_vae_decode"]
