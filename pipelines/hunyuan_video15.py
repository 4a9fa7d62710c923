"""HunyuanVideo 1.5 text-to-video (Tencent Hunyuan 2025, 8.3B; github.com/Tencent-Hunyuan/HunyuanVideo-1.5) as a
``FlowPolicy`` (``model.pipeline: hunyuan-video-1.5``), over diffusers ``HunyuanVideo15Pipeline`` components.

**Latents.** The causal video VAE's (``AutoencoderKLHunyuanVideo15``: 16x spatial, 4x temporal, 32 channels)
``[B, 32, F', H/16, W/16]`` with ``F' = (F - 1) / 4 + 1`` latent frames for ``F = num_frames`` video frames
(``F = 4k + 1``), unpatched (the transformer's patch is 1 x 1 x 1). The transformer takes 65 channels: the
pipeline's text-to-video call concatenates a zero "condition" video and a zero mask channel to the latents
(``prepare_cond_latents_and_mask``), and zero SigLIP image embeddings (``vision_num_semantic_tokens`` = 729 tokens,
masked out inside the model); :meth:`HunyuanVideo15Policy.transformer_inputs` adds them. The 3D DiT is the
trainable part; the text encoders and the VAE are frozen. Decoding: ``z / scaling_factor``, VAE decode, ``x / 2 +
0.5`` clamped, as videos ``[B, 3, F, H, W]``; the adapter gives the VAE's causal attention mask its head axis
(:func:`batch_safe`), without which diffusers 0.42.1's VAE decodes a batch of one video only.

**Conventions** (``HunyuanVideo15Pipeline.__call__``). Rectified flow with the SD3 velocity convention
(``x_sigma = (1 - sigma) x0 + sigma noise``, prediction ``noise - x0``); time input ``timestep = sigma * 1000``
(``scheduler.timesteps``). Guidance is the pipeline's ``guider`` (``ClassifierFreeGuidance``: ``u + s (c - u)``
against ``negative_prompt``, the pipeline's default ``""``, which its template renders as ``" "``); flowrl runs
both halves in one doubled batch (the guider: two passes). The guider's ``guidance_scale`` is the published
default (6.0; the distilled checkpoints' 1.0: no guidance); a guider with a rescale, the original formulation or a
step range is refused (not reproduced). The schedule is the pipeline's: ``linspace(1, 0, T + 1)[:-1]`` through its
static-shift scheduler (shift 5.0 for 480p, 9.0 for 720p), then 0.

**Text.** Two encoders, as the pipeline's own encoders run them: Qwen2.5-VL-7B's language model on the chat
template with the pipeline's video system message, the hidden state two layers below the last, the template's
first 108 tokens cut off (``prompt_template_encode_start_idx``), padded to ``max_sequence_length`` tokens (the
pipeline's ``tokenizer_max_length``, 1000) with its mask; and ByT5 (Glyph-SDXL-v2) on the quoted text of the prompt
(``"..."``), 256 tokens, zero with a zero mask when the prompt quotes nothing. Inside the transformer the valid
tokens of the three streams are moved to the front (a data-dependent reordering; see the planning note below).

**Planning.** ``HunyuanVideo15Transformer3DModel.forward`` reorders the conditioning tokens with boolean masks
(``text[text_mask]``) and branches on ``torch.all(image_embeds == 0)``: both need values, which meta tensors (what
``flowrl plan`` measures on) do not have. The planner's transformer (:meth:`transformer_component`) is the diffusers
class whose forward runs, on meta inputs only, under :class:`MetaTokenOrder`: the text-to-video branch, and every
masked selection of the reordering at the size that keeps the sequence whole (the valid selections whole, the
padding selections empty). The shapes, and so the bytes, are the real forward's; real tensors take the diffusers
forward unchanged.

**LoRA export and context parallelism.** diffusers 0.42.1 gives ``HunyuanVideo15Pipeline`` no LoRA loader: the
export loads into its transformer (:meth:`HunyuanVideo15Policy.load_exported_lora`). Its transformer declares no
``_cp_plan``: ``train.context_parallel`` > 1 is refused (``flowrl.distributed.context.cp_plan``).
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from flowrl.options import Guidance, PositiveInt

from .base import IMAGE_SIZE, DiffusersPolicy, TransformerLoraExport
from .common import (Resolution, Schedule, Shift, TextTokens, check_scheduler, resolve_resolution, scheduler_sigmas,
                     vae_decode)
from .facts import Component, Geometry, ModelConfigs
from .qwen_family import QWEN25_VL_7B

# LoRA targets: the double-stream blocks' joint-attention projections of both streams and both feed-forwards (the
# layout of Flow-Factory's default targets for the MMDiT video and image models, e.g. its FLUX.2 and Qwen-Image
# adapters; no RL peer trains HunyuanVideo 1.5). The suffixes also match the text refiner's attention and
# feed-forward (context_embedder.token_refiner), which conditions every block. A loaded policy's own list leaves out
# the last block's unused text-stream outputs (live_lora_targets).
HUNYUAN_VIDEO15_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)
# the last block's text stream feeds nothing (the model returns the video stream): LoRA there gets no gradient
LAST_BLOCK_UNUSED = ("attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2")
DEFAULT_NUM_FRAMES = 121  # HunyuanVideo15Pipeline's default
DEFAULT_ASPECT = (9, 16)  # the pipeline's default_aspect_ratio (height : width) at the transformer's target_size
VISION_TOKENS = 729  # the pipeline's vision_num_semantic_tokens (zero SigLIP embeddings in text-to-video)
BYT5_TOKENS = 256  # the pipeline's tokenizer_2_max_length
TINY_NUM_FRAMES = 5  # two latent frames: the tiny model's default (flowrl.json)

# Published configs (the repositories' */config.json, as diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
# writes them for hunyuanvideo-community/HunyuanVideo-1.5-*): transformer/config.json TRANSFORMER_CONFIGS["480p_t2v"]
# (54 double-stream blocks, 16 heads of 128 = 2048 wide, 65 input channels; "720p_t2v" differs only in target_size
# 960; "480p_t2v_distilled" is 480p_t2v's), scheduler shift 5.0 (480p) / 9.0 (720p), guider guidance_scale 6.0
# (1.0 for the distilled checkpoints)
HUNYUAN_VIDEO15_480P = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                            num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                            qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
                            rope_theta=256.0, rope_axes_dim=(16, 56, 56), use_meanflow=False, target_size=640,
                            task_type="t2v")
HUNYUAN_VIDEO15_720P = dict(HUNYUAN_VIDEO15_480P, target_size=960)
# vae/config.json: AutoencoderKLHunyuanVideo15() with its defaults (the conversion script builds it so)
HUNYUAN_VIDEO15_VAE = dict(in_channels=3, out_channels=3, latent_channels=32, layers_per_block=2,
                           block_out_channels=[128, 256, 512, 1024, 1024], spatial_compression_ratio=16,
                           temporal_compression_ratio=4, downsample_match_channel=True, upsample_match_channel=True,
                           scaling_factor=1.03682)
# text_encoder/config.json: Qwen/Qwen2.5-VL-7B-Instruct's language model (Qwen2_5_VLTextModel; the conversion script
# keeps text_encoder.language_model); text_encoder_2/config.json: google/byt5-small (T5EncoderModel: 12 layers,
# 1472 wide). The published vocabulary is byt5-small's 384 plus Glyph-SDXL-v2's color and font tokens
# (add_special_token); their count is not read here (a few hundred rows of 1472: under 1M parameters)
BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                  relative_attention_num_buckets=32, relative_attention_max_distance=128,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, pad_token_id=0,
                  eos_token_id=1)
HUNYUAN_TEXT_ENCODERS = {"text_encoder": Component("transformers:Qwen2_5_VLTextModel", QWEN25_VL_7B["text_config"]),
                         "text_encoder_2": Component("transformers:T5EncoderModel", BYT5_SMALL)}


def _published(hub_id: str, transformer: dict, title: str, arch: str) -> ModelConfigs:
    vae = Component("flowrl.pipelines.hunyuan_video15:batched_vae", HUNYUAN_VIDEO15_VAE)  # see batch_safe
    return ModelConfigs(transformer, HUNYUAN_TEXT_ENCODERS, vae, hub_id, title, arch)


def batch_safe(vae):
    """``vae`` (an ``AutoencoderKLHunyuanVideo15``) decoding batches: in diffusers 0.42.1 its mid-block attention
    (``HunyuanVideo15AttnBlock``) builds the causal mask ``[B, S, S]`` for queries ``[B, 1, S, C]``, which broadcasts
    only for a batch of one (``HunyuanVideo15Pipeline`` cannot decode two videos at once). Each block's mask gets its
    head axis, ``[B, 1, S, S]``: the same mask, the same result for one video. Returns ``vae``."""
    for m in vae.modules():
        if type(m).__name__ == "HunyuanVideo15AttnBlock" and not hasattr(m, "_flowrl_batch_safe"):
            make = type(m).prepare_causal_attention_mask
            m.prepare_causal_attention_mask = lambda *a, make=make, **kw: _head_axis(make(*a, **kw))
            m._flowrl_batch_safe = True
    return vae


def _head_axis(mask: torch.Tensor) -> torch.Tensor:
    return mask.unsqueeze(1) if mask.ndim == 3 else mask  # [B, S, S] -> [B, 1, S, S]


def batched_vae(**config):
    """An ``AutoencoderKLHunyuanVideo15`` of ``config`` that decodes batches (:func:`batch_safe`; what the planner
    builds)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return batch_safe(AutoencoderKLHunyuanVideo15(**config))


def live_lora_targets(num_blocks: int, targets) -> list[str]:
    """``targets`` (peft suffixes) without the last block's :data:`LAST_BLOCK_UNUSED` modules: each such suffix as the
    other blocks' names (``transformer_blocks.{i}.<suffix>``), so every LoRA weight gets a gradient (DDP needs it)."""
    out: list[str] = []
    for t in targets:
        out += [f"transformer_blocks.{i}.{t}" for i in range(num_blocks - 1)] if t in LAST_BLOCK_UNUSED else [t]
    return out


def tiny_tokenizer():
    """An offline byte-level BPE ``Qwen2Tokenizer`` for the tiny model (``pipelines/tiny.py``'s: Qwen2's
    pre-tokenizer, byte alphabet and special tokens) whose vocabulary holds every word of the pipeline's system
    message as one token and its runs of 8 spaces (the message's line continuations) as one, so the template's
    prefix is 108 tokens, as ``prompt_template_encode_start_idx`` assumes of Qwen2.5-VL's tokenizer: the cut leaves
    the prompt's own tokens. ChatML template (Qwen2.5-VL's rendering of text turns), right padding."""
    import inspect
    import re

    from diffusers import HunyuanVideo15Pipeline
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    from .tiny import QWEN3_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS, byte_level_vocab

    message = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    vocab, merges = byte_level_vocab(tuple(dict.fromkeys(re.findall(r"[A-Za-z]+", message))),
                                     ("system", "user", "assistant", "You"))
    space = "\u0120"  # the byte-level spelling of " "
    for n in (1, 2, 4):  # 8 spaces: three doublings, as Qwen2's merges build space runs
        if space * 2 * n not in vocab:
            vocab[space * 2 * n] = len(vocab)
            merges.append((space * n, space * n))
    for t in QWEN_SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768, eos_token="<|im_end|>")
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    tok.chat_template = QWEN3_CHAT_TEMPLATE  # ChatML: what Qwen2.5-VL's template renders for text turns
    tok.padding_side = "right"  # as the conversion script loads Qwen2.5-VL's tokenizer
    return tok


def default_size(target_size: int) -> tuple[int, int]:
    """The pipeline's ``(height, width)`` when none is given: the 16:9 bucket of ``target_size`` pixels
    (``HunyuanVideo15ImageProcessor.calculate_default_height_width``; 640 -> (480, 848), 960 -> (720, 1280))."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    h, w = HunyuanVideo15ImageProcessor(vae_scale_factor=16).calculate_default_height_width(
        *DEFAULT_ASPECT, int(target_size))
    return int(h), int(w)


class MetaTokenOrder(TorchFunctionMode):
    """The data-dependent steps of ``HunyuanVideo15Transformer3DModel.forward`` on meta tensors, at the shapes
    they take (module doc, "Planning"): ``torch.all`` (the text-to-video test) is true; a selection by a
    boolean mask keeps every row, a selection by an inverted mask (``~mask``, the padding) none, so the
    reordered sequence ``[valid..., padding...]`` has its real length. Only meta tensors are affected."""

    def __init__(self):
        super().__init__()
        self._inverted: list[torch.Tensor] = []  # the ~mask tensors made inside the block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
        if meta and func is torch.all:
            return torch.tensor(True)
        if meta and func is torch.Tensor.__invert__ and args[0].dtype == torch.bool:
            out = func(*args, **kwargs)
            self._inverted.append(out)
            return out
        if meta and func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and \
                args[1].dtype == torch.bool:
            x, mask = args
            keep = 0 if any(mask is m for m in self._inverted) else mask.shape[0]
            return func(x, slice(0, keep), **kwargs)  # [keep, ...]
        return func(*args, **kwargs)


def planned_transformer(**config):
    """A ``HunyuanVideo15Transformer3DModel`` of ``config`` whose forward runs under :class:`MetaTokenOrder` when its
    inputs are meta tensors (``flowrl plan``); real inputs take diffusers' forward as it is."""
    from diffusers import HunyuanVideo15Transformer3DModel

    model = HunyuanVideo15Transformer3DModel(**config)
    forward = model.forward

    def meta_safe(*args, **kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(x, torch.Tensor) and x.is_meta:
            with MetaTokenOrder():
                return forward(*args, **kwargs)
        return forward(*args, **kwargs)

    model.forward = meta_safe
    return model


class HunyuanVideo15Policy(TransformerLoraExport, DiffusersPolicy):
    """``FlowPolicy`` for HunyuanVideo 1.5 text-to-video (module doc).

    Args:
        pipe: a loaded ``HunyuanVideo15Pipeline`` (its components are used, not its loop).
        guidance_scale: CFG scale; 1.0 = no guidance (one pass). The published guider's 6.0 is the default (the
            distilled checkpoints: 1.0).
        negative_prompt: the unconditional prompt (the pipeline's default ``""``).
        max_sequence_length: Qwen2.5-VL tokens after the template (the pipeline's ``tokenizer_max_length``, 1000).
        num_frames: video frames ``F``, ``4k + 1``; None = ``flowrl.json``'s, else the pipeline's 121.
        shift: None (default) = the pipeline's schedule; a float replaces it by ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: frame size in pixels, int or (H, W), multiples of 16; None = ``flowrl.json``'s, else the
            pipeline's default (480 x 848 for the 480p models).
        device: where the models and all returned tensors live.
    """

    kind = "hunyuan-video-1.5"
    pipeline_class = "HunyuanVideo15Pipeline"
    transformer_class = "HunyuanVideo15Transformer3DModel"
    lora_target_modules = HUNYUAN_VIDEO15_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tiny_kinds = ("hunyuan-video-1.5",)
    tiny_num_frames = TINY_NUM_FRAMES
    example_hub_id = "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v"
    cond_keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
    published = {m.source: m for m in (
        _published(example_hub_id, HUNYUAN_VIDEO15_480P, "HunyuanVideo-1.5-480p_t2v", "hunyuan-video-1.5-arch"),
        _published("hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v", HUNYUAN_VIDEO15_720P,
                   "HunyuanVideo-1.5-720p_t2v", "hunyuan-video-1.5-720p-arch"))}

    def __init__(self, pipe, *, guidance_scale: Guidance = 6.0, negative_prompt: str = "",
                 max_sequence_length: TextTokens = 1000, num_frames: Optional[PositiveInt] = None,
                 shift: Shift = None, schedule: Schedule = "diffusers", resolution: Resolution = None,
                 device: Union[str, torch.device] = "cpu"):
        num_frames = DEFAULT_NUM_FRAMES if num_frames is None else num_frames
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule,
                           num_frames=num_frames)
        check_scheduler(type(self).__name__, pipe.scheduler.config, shift, schedule)
        self._check_guider(pipe.guider)
        ft = int(pipe.vae_scale_factor_temporal)
        if (num_frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for HunyuanVideo 1.5's video VAE, "
                             f"got {num_frames!r}")
        pipe.vae_scale_factor = pipe.vae_scale_factor_spatial  # the name the base's _setup reads
        batch_safe(pipe.vae)  # decodes batches (diffusers 0.42.1's causal mask broadcasts for one video only)
        self._setup(pipe, device)  # frozen VAE / text encoders, LoRA targets, negative cache
        cfg, f = self.transformer.config, self.vae_scale_factor
        self.lora_target_modules = live_lora_targets(int(cfg.num_layers), self.lora_target_modules)
        self.height, self.width = resolve_resolution(resolution, default_size(cfg.target_size), f * cfg.patch_size)
        self.latent_shape = (int(cfg.out_channels), (num_frames - 1) // ft + 1, self.height // f,
                             self.width // f)  # (C, F', h, w)

    @staticmethod
    def _check_guider(guider) -> None:
        """The pipeline's guider must be plain CFG (what flowrl's velocity reproduces)."""
        cfg = guider.config
        bad = {k: cfg.get(k) for k, plain in (("guidance_rescale", 0.0), ("use_original_formulation", False),
                                               ("start", 0.0), ("stop", 1.0), ("enabled", True))
               if cfg.get(k, plain) != plain}
        if type(guider).__name__ != "ClassifierFreeGuidance" or bad:
            raise ValueError(f"HunyuanVideo15Policy reproduces plain classifier-free guidance only; this model's "
                             f"guider is {type(guider).__name__} with {bad or 'another rule'}: give the pipeline a "
                             f"ClassifierFreeGuidance() guider (guidance_scale comes from model.guidance_scale)")

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        return int(configs.vae.config["spatial_compression_ratio"])

    @classmethod
    def latent_channels(cls, transformer: dict) -> int:
        """The VAE's 32 channels (the transformer's ``out_channels``; its input adds the condition and the mask)."""
        return int(transformer["out_channels"])

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        """``options['num_frames']`` video frames (default 121, ``4 k + 1``) of ``options['resolution']`` (default
        the pipeline's 16:9 bucket of the transformer's ``target_size``): latents ``(32, (F - 1) / 4 + 1, H / 16,
        W / 16)``; the text tokens are the Qwen2.5-VL ones (the ByT5 and image tokens come on top)."""
        f = cls.vae_factor(configs)
        ft = int(configs.vae.config["temporal_compression_ratio"])
        frames = options.get("num_frames") or DEFAULT_NUM_FRAMES
        if not isinstance(frames, int) or (frames - 1) % ft:
            raise ValueError(f"num_frames must be {ft} k + 1 frames (k >= 0) for HunyuanVideo 1.5's video VAE, "
                             f"got {frames!r}")
        default = default_size(configs.transformer.get("target_size", 640))
        h, w = resolve_resolution(options.get("resolution") or default, 0,
                                  f * cls.patch_size(configs.transformer))
        shape = (cls.latent_channels(configs.transformer), (frames - 1) // ft + 1, h // f, w // f)  # (C, F', h, w)
        return Geometry(h, w, shape, cls.text_tokens(options), frames)

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL states ``[rows, L, text_embed_dim]`` and ByT5 states ``[rows, 256, text_embed_2_dim]``, each
        with an int64 mask."""
        c = configs.transformer
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, c["text_embed_dim"], device=device,
                                             dtype=dtype),  # [B, L, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.int64),
                "prompt_embeds_2": torch.empty(rows, BYT5_TOKENS, c["text_embed_2_dim"], device=device,
                                               dtype=dtype),  # [B, 256, D2]
                "prompt_embeds_mask_2": torch.empty(rows, BYT5_TOKENS, device=device, dtype=torch.int64)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Latents ``[B, C, F', h, w]`` with the text-to-video zero condition and mask channels (``[B, 2C + 1, F',
        h, w]``), zero image embeddings ``[B, 729, image_embed_dim]``, ``timestep = sigma * 1000``, both text
        streams and their masks, all in the transformer's ``dtype`` as the pipeline passes them (its time embedding
        runs in the timestep's dtype)."""
        b, c, f, h, w = x.shape
        hidden = torch.cat([x.to(dtype), x.new_zeros((b, c + 1, f, h, w), dtype=dtype)], dim=1)  # [B, 2C+1, F', h, w]
        image = torch.zeros(b, VISION_TOKENS, config["image_embed_dim"], device=x.device, dtype=dtype)  # [B, 729, Di]
        dev = x.device
        return dict(hidden_states=hidden, timestep=(sigma * 1000.0).to(dtype), image_embeds=image,
                    encoder_hidden_states=cond["prompt_embeds"].to(dev, dtype),  # [B, L, D]
                    encoder_attention_mask=cond["prompt_embeds_mask"].to(dev, dtype),  # [B, L]
                    encoder_hidden_states_2=cond["prompt_embeds_2"].to(dev, dtype),  # [B, 256, D2]
                    encoder_attention_mask_2=cond["prompt_embeds_mask_2"].to(dev, dtype), return_dict=False)

    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """The diffusers transformer, planned on meta tensors through :func:`planned_transformer` (module doc)."""
        return Component("flowrl.pipelines.hunyuan_video15:planned_transformer", transformer)

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2,
                "num_refiner_layers": 1, "mlp_ratio": 2.0, "text_embed_dim": 16, "text_embed_2_dim": 32,
                "image_embed_dim": 12, "rope_axes_dim": (2, 2, 4)}

    @classmethod
    def tiny_components(cls, kind: str = "hunyuan-video-1.5", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``HunyuanVideo15Pipeline``: a 2-block ``HunyuanVideo15Transformer3DModel`` (the published 480p
        config shrunk: 2 heads of 8, one refiner block, 65 input / 32 output channels), an
        ``AutoencoderKLHunyuanVideo15`` with the real layout (32 channels, 16x spatial, 4x temporal: five levels)
        at widths 8 to 32 (its decoder's first level must be a multiple of the 32 latent channels; its encoder, which
        text-to-video never runs, does not work at these widths), a 2-layer ``Qwen2_5_VLTextModel`` 16 wide over
        :func:`tiny_tokenizer` (the template's prefix of 108 tokens), a 2-layer ``T5EncoderModel`` 32 wide over
        ``ByT5Tokenizer()`` (byte-level, offline), the 480p scheduler (static shift 5.0) and guider (6.0). Sizes as
        diffusers' HunyuanVideo 1.5 fast tests."""
        from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler,
                               HunyuanVideo15Transformer3DModel)
        from diffusers.guiders import ClassifierFreeGuidance
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

        from .tiny import t5_encoder

        tok = tiny_tokenizer()
        ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tok), hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, rope_theta=1e6, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})).eval()
        tok_2 = ByT5Tokenizer()
        torch.manual_seed(seed + 1)
        text_encoder_2 = t5_encoder(len(tok_2), 32).eval()
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLHunyuanVideo15(**{**HUNYUAN_VIDEO15_VAE, "block_out_channels": [8, 8, 8, 8, 32],
                                             "layers_per_block": 1}).eval()  # the decoder's first level: 32
        torch.manual_seed(seed + 3)
        transformer = HunyuanVideo15Transformer3DModel(**cls.shrink_config(HUNYUAN_VIDEO15_480P))
        return dict(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                    text_encoder=text_encoder, tokenizer=tok, text_encoder_2=text_encoder_2, tokenizer_2=tok_2,
                    guider=ClassifierFreeGuidance(guidance_scale=6.0))

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Qwen2.5-VL ``prompt_embeds`` [B, max_sequence_length, D] and ByT5 ``prompt_embeds_2`` [B, 256, D2] with
        their int64 masks, by the pipeline's own encoders (module doc)."""
        pipe = self.pipe
        pe, mask = pipe._get_mllm_prompt_embeds(
            text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, prompt=list(prompts), device=self.device,
            tokenizer_max_length=self.max_sequence_length, system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx)  # [B, L, D], [B, L]
        pe_2, mask_2 = pipe._get_byt5_prompt_embeds(
            tokenizer=pipe.tokenizer_2, text_encoder=pipe.text_encoder_2, prompt=list(prompts), device=self.device,
            tokenizer_max_length=pipe.tokenizer_2_max_length)  # [B, 256, D2], [B, 256]
        return {"prompt_embeds": pe, "prompt_embeds_mask": mask.long(), "prompt_embeds_2": pe_2,
                "prompt_embeds_mask_2": mask_2.long()}

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas ``HunyuanVideo15Pipeline`` gives its scheduler (module doc)."""
        return scheduler_sigmas(self.pipe.scheduler, np.linspace(1.0, 0.0, num_steps + 1)[:-1])

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 32, F', h, w]`` -> float32 videos ``[B, 3, F, 16 h, 16 w]`` in [0, 1] (module doc), through
        the VAE made batch-safe (:func:`batch_safe`)."""
        return vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, F, H, W]


__all__ = ["HUNYUAN_VIDEO15_480P", "HUNYUAN_VIDEO15_720P", "HUNYUAN_VIDEO15_LORA_TARGET_MODULES", "HUNYUAN_VIDEO15_VAE",
           "HunyuanVideo15Policy", "MetaTokenOrder", "planned_transformer"]
