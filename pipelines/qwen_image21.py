"""Qwen-Image 2.1 (Qwen 2026; a 7B single-stream DiT) as a ``FlowPolicy``, over diffusers ``QwenImage21Pipeline``
components (text-to-image).

**Latents.** The policy's latents are the VAE's ``[B, 64, h, w]`` (``h = H / 16``: ``AutoencoderKLQwenImage21``
compresses 16x into 64 channels, RGBA). The transformer takes them unpatched: ``transformer_inputs`` flattens
the grid row-major into ``[B, h w, 64]`` tokens (``QwenImage21Pipeline._pack_latents``; the pipeline's frame axis
of length 1 does not change the layout), and its output's last ``h w`` tokens are the velocity. The grid must be
even (each vision slot of the text encoder's sequence stands for 2 x 2 latent tokens): resolutions are multiples
of 32 pixels, as the pipeline rounds them.

**Text.** The pipeline's own ``encode_prompt``: its raw chat template with the system prompt "Comprehend and
analyze the provided prompt.", Qwen3-VL's last decoder layer before its final norm (the pipeline's hook), the
system tokens dropped, each prompt's own tokens only. flowrl pads every prompt to ``max_sequence_length`` with
its int64 mask (batch-first conditioning of one width); a longer prompt keeps its first ``max_sequence_length``
tokens (the pipeline has no limit; the text encoder is causal, so the kept tokens are the ones it encodes).

**One sequence, block-causal.** The transformer runs one joint sequence ``[text, image]``: text tokens causal,
the image block bidirectional, text and image sharing 3-axis RoPE positions in which the image's frame position is
the text's length. In a batch every row shares row 0's layout, so diffusers' batched pipeline places a shorter
prompt's image after the batch's longest prompt (its output depends on its batch-mates; diffusers' own test
allows 2e-3 for it). flowrl's ``velocity`` runs each set of rows with one prompt length in its own transformer
call, trimmed to that length (one call when they agree, as in a GRPO group): every row gets the velocity the
pipeline gives it alone, whatever its batch. A forward whose rows have k different prompt lengths runs k
transformer calls (``docs/models.md``: keep such batches on one process).

**Time and schedule.** The time input is the pipelines' ``(1000 sigma) / 1000``; the transformer modulates text
tokens from t = 0 (``causal_condition``). The schedule is Qwen-Image's (:func:`qwen_pipeline_sigmas`: dynamic
exponential shift from the image's token count, ``shift_terminal``); a checkpoint whose pipeline config fixes
``sample_sigmas`` (a distilled grid) is sampled on that grid, with exactly that many steps. The pipeline's prefix
KV cache is not used: every step runs the whole sequence (equal values; the cache only saves recomputing the
text's keys).

**Guidance.** Qwen-Image 2.1 is CFG-distilled: its transformer has no guidance input (no embedding: the guidance
it was distilled with is in its weights), and Qwen samples it without guidance (40 steps, ``true_cfg_scale`` 1).
``guidance_scale`` 1.0 (the default) is one pass per step, in sampling, in the KL reference (the same call with
the LoRA off) and in evaluation alike; ``guidance_scale > 1`` adds real CFG against ``negative_prompt`` as the
pipeline's ``true_cfg_scale`` does (``u + s (c - u)``, no norm rescale, the two halves as two calls as the pipeline
runs them), everywhere at once.

**Decoding.** ``z * latents_std + latents_mean`` per channel (the pipeline multiplies), the VAE on ``[B, 64, 1, h,
w]``, frame 0, ``x / 2 + 0.5`` clamped: RGBA images whose alpha channel flowrl drops (the colour channels, as PIL's
RGBA -> RGB conversion keeps them; rewards score RGB).
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from flowrl.options import Guidance

from .base import IMAGE_SIZE, DiffusersPolicy
from .common import DECODE_BATCH, Resolution, Schedule, Shift, TextTokens, cfg_combine, module_dtype
from .facts import Component, ModelConfigs
from .qwen_family import QwenVideoVaeFacts, pad_text, qwen_pipeline_sigmas, tiny_qwen3_vl
from .tiny import build_qwen_tokenizer

# Published configs of Qwen/Qwen-Image-2.1 (its */config.json; flowrl plan and bench precision build the models from
# them, no download). transformer/config.json: 32 single-stream blocks of 32 heads of 128 (4096 wide), 64 unpatched
# latent channels, Qwen3-VL-8B features of 4096, MLP ratio 3, RoPE (16, 56, 56), causal_condition: as diffusers'
# QwenImage21Transformer2DModel defaults and the repository's own README ("32 Single-Stream DiT layers", "7B"), and
# as third-party readers of the repository quote the file (the mlx-community conversion's profile checks, DiffSynth-
# style fp8 loaders)
QWEN_IMAGE21_7B = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                       num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6,
                       causal_condition=True)
# text_encoder/config.json: Qwen/Qwen3-VL-8B-Instruct as Qwen3VLForConditionalGeneration (36 layers 4096 wide, 32
# query / 8 KV heads of 128, untied output head, interleaved M-RoPE [24, 20, 20] at theta 5e6; a 27-block vision tower
# 1152 wide with DeepStack taps 8 / 16 / 24), as copied by third-party readers of the repository
QWEN3_VL_8B = dict(
    text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                     max_position_embeddings=262144, rms_norm_eps=1e-6, attention_bias=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                                      "mrope_interleaved": True}),
    vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304, out_hidden_size=4096,
                       deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=False)
# vae/config.json: AutoencoderKLQwenImage21 (RGBA in and out, 64 latent channels, 16x spatial: base 96 / decoder 144,
# dim_mult [1, 2, 4, 8, 8], four downsampling stages): diffusers' defaults for the class, which the mlx-community
# conversion's profile also checks; its latent mean / std are the class defaults (the planner does not read them)
QWEN_IMAGE21_VAE = dict(base_dim=96, decoder_base_dim=144, z_dim=64, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=2,
                        attn_scales=[], temperal_downsample=[False, True, True, True], dropout=0.0, is_residual=True,
                        in_channels=4, out_channels=4, patch_size=None, scale_factor_temporal=8,
                        scale_factor_spatial=16)
# scheduler/scheduler_config.json: Qwen-Image's (dynamic exponential shift 0.5 -> 0.9 over 256 -> 8192 tokens,
# shift_terminal 0.02), as the mlx-community conversion's profile checks it (no copy of the file itself was found)
QWEN_IMAGE21_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                              max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                              time_shift_type="exponential")

# Flow-Factory's default LoRA targets for Qwen-Image 2.1 (src/flow_factory/models/qwen_image_21/qwen_image_21.py;
# r=64, alpha=128): every projection of each single-stream block, attention and SwiGLU
QWEN_IMAGE21_LORA_TARGET_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj",
                                    "img_mlp.gate_layer", "img_mlp.out")
# a Qwen3-VL chat template for the system message the pipeline renders (text parts of a content list, or a string)
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- else %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def flatten_latents(x: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, h w, C]``, tokens row-major (``QwenImage21Pipeline._pack_latents``)."""
    return x.flatten(2).transpose(1, 2)


def unflatten_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`flatten_latents`: ``[B, h w, C]`` -> ``[B, C, h, w]``."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)


def rgba_vae_decode(vae, latents: torch.Tensor, device, batch: Optional[int] = DECODE_BATCH) -> torch.Tensor:
    """Latents ``[B, 64, h, w]`` -> float32 RGB images ``[B, 3, 16 h, 16 w]`` in [0, 1], as ``QwenImage21Pipeline``
    decodes: ``z * latents_std + latents_mean`` per channel, the VAE on one frame (``[B, 64, 1, h, w]`` -> RGBA ``[B,
    4, 1, H, W]`` in [-1, 1]), ``x / 2 + 0.5`` clamped, the alpha channel dropped. ``batch`` images per call."""
    cfg = vae.config
    dtype = module_dtype(vae)
    std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)  # [1, C, 1, 1, 1]
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(device, dtype)  # [1, C, 1, 1, 1]
    step = batch or max(1, len(latents))
    out = []
    for i in range(0, len(latents), step):
        z = latents[i:i + step, :, None].to(device, dtype) * std + mean  # [b, C, 1, h, w]
        with torch.no_grad():
            img = vae.decode(z, return_dict=False)[0][:, :, 0]  # [b, 4, H, W] in [-1, 1]
        out.append((img.float() / 2 + 0.5).clamp(0, 1)[:, :3])  # [b, 3, H, W]: RGB
    return torch.cat(out)  # [B, 3, H, W]


@functools.lru_cache(maxsize=None)
def plan_transformer_class():
    """``QwenImage21Transformer2DModel`` with a forward that also runs on meta tensors (``flowrl plan``): on real
    tensors the diffusers forward; on meta ones the same submodules in the same order on the joint ``[text, image]``
    sequence (text and image projections, the shared modulation with its t = 0 row, every block, the final norm and
    projection) without the data-dependent token placement and RoPE tables, whose values meta tensors lack; the
    blocks attend unmasked (the kernel's memory is that of the masked one)."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    class QwenImage21PlanTransformer(QwenImage21Transformer2DModel):
        def forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                    encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None, kv_cache_mode=None,
                    return_dict: bool = True):
            if hidden_states.device.type != "meta":
                return super().forward(hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                                       encoder_hidden_states_mask, attention_kwargs, kv_cache, kv_cache_mode,
                                       return_dict)
            joint = torch.cat([self.txt_in(encoder_hidden_states), self.img_in(hidden_states)], 1)  # [B, S, D]
            t = timestep.to(joint.dtype)
            target = None
            if self.config.causal_condition:  # text tokens modulate from an extra t = 0 row
                t = torch.cat([t, t.new_zeros(1)])  # [B + 1]
                target = torch.empty(joint.shape[1], dtype=torch.bool, device="meta")  # [S]
            temb = self.time_text_embed(t, joint)  # [B (+1), D]
            modulation = self.modulation(temb)  # [B (+1), 4D]
            rope = torch.empty(joint.shape[1], self.config.attention_head_dim // 2, dtype=torch.complex64,
                               device="meta")  # [S, d/2]
            for block in self.transformer_blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    joint = self._gradient_checkpointing_func(block, joint, modulation, rope, None, target)
                else:
                    joint = block(hidden_states=joint, modulation=modulation, rotary_emb=rope, target_token_mask=target)
            out = self.proj_out(self.norm_out(joint, temb, target))  # [B, S, C]
            return (out,) if not return_dict else Transformer2DModelOutput(sample=out)

    # named as its base: messages that name the transformer (e.g. "declares no context-parallel plan") name diffusers'
    QwenImage21PlanTransformer.__name__ = QwenImage21PlanTransformer.__qualname__ = "QwenImage21Transformer2DModel"
    return QwenImage21PlanTransformer


class QwenImage21Policy(QwenVideoVaeFacts, DiffusersPolicy):
    """``FlowPolicy`` for Qwen-Image 2.1, text-to-image (see module doc).

    Args:
        pipe: a loaded ``QwenImage21Pipeline`` (its components are used, not its loop).
        guidance_scale: 1.0 (default) = no CFG, the model's distilled behaviour, one pass; > 1 = the pipeline's
            ``true_cfg_scale``, real CFG against ``negative_prompt`` (two passes).
        negative_prompt: the unconditional prompt of real CFG (the pipeline encodes ``""`` as ``" "``).
        max_sequence_length: text tokens of the batch-first conditioning (the template's user and assistant
            markers included); a longer prompt keeps its first tokens (module doc).
        shift: None (default) = the pipeline's own schedule (module doc); a float replaces it by
            ``flow_sigmas(T, shift, schedule)``.
        schedule: ``"diffusers"`` or ``"linear"`` (used only with ``shift``).
        resolution: image size in pixels, int or (H, W), multiples of 32; None = ``flowrl.json``'s, else the
            pipeline's default ``output_resolution`` 1024.
        device: where the models and all returned tensors live.
    """

    kind = "qwen-image-2.1"
    pipeline_class = "QwenImage21Pipeline"
    transformer_class = "QwenImage21Transformer2DModel"
    lora_target_modules = QWEN_IMAGE21_LORA_TARGET_MODULES
    text_encoder_names = ("text_encoder",)
    tiny_kinds = ("qwen-image-2.1",)
    example_hub_id = "Qwen/Qwen-Image-2.1"
    cond_keys = ("prompt_embeds", "prompt_embeds_mask")  # _forward(x, sigma, *these)
    # --smoke: the tiny tokenizer's template spends 13 tokens on "a photo of a cat": 32 keep whole prompts
    smoke_model_options = {"max_sequence_length": 32}
    published = {example_hub_id: ModelConfigs(
        QWEN_IMAGE21_7B, {"text_encoder": Component("transformers:Qwen3VLForConditionalGeneration", QWEN3_VL_8B)},
        Component("diffusers:AutoencoderKLQwenImage21", QWEN_IMAGE21_VAE), example_hub_id, "Qwen-Image-2.1",
        "qwen-image-2.1-arch")}

    def __init__(self, pipe, *, guidance_scale: Guidance = 1.0, negative_prompt: str = " ",
                 max_sequence_length: TextTokens = 512, shift: Shift = None, schedule: Schedule = "diffusers",
                 resolution: Resolution = None, device: Union[str, torch.device] = "cpu"):
        self._keep_options(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                           max_sequence_length=max_sequence_length, shift=shift, schedule=schedule)
        if pipe.scheduler.config.get("invert_sigmas") and shift is None:
            raise ValueError("QwenImage21Policy's schedule runs from 1 to 0; this scheduler inverts its sigmas "
                             "(invert_sigmas=True): pass shift= to use flowrl's static-shift schedule instead")
        self._setup(pipe, device)  # frozen VAE / text encoder, vae_scale_factor (16), LoRA targets, negative cache
        self._image_geometry(resolution, 1024, int(self.transformer.config.in_channels))  # the pipeline's 1024 px
        h, w = self.latent_shape[1:]
        self.image_seq_len = h * w  # unpatched: one token per latent pixel

    # --- declarations ----------------------------------------------------------------------
    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        """The resolution multiple's factor: even latent grids (a vision slot covers 2 x 2 latent tokens; 32 px)."""
        return 2

    @classmethod
    def tiny_multiple(cls) -> int:
        return 32

    @classmethod
    def default_resolution(cls, configs: ModelConfigs) -> int:
        return 1024  # QwenImage21Pipeline's output_resolution

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict[str, torch.Tensor]:
        """Qwen3-VL features ``[rows, L, context_in_dim]`` and their int64 mask ``[rows, L]``."""
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["context_in_dim"],
                                             device=device, dtype=dtype),  # [B, L, D]
                "prompt_embeds_mask": torch.empty(rows, geometry.text_tokens, device=device, dtype=torch.int64)}

    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """The transformer as ``flowrl plan`` and the architecture benchmark build it: ``QwenImage21Transformer2DModel``
        whose forward also runs on meta tensors (:func:`plan_transformer_class`)."""
        return Component("flowrl.pipelines.qwen_image21:QwenImage21PlanTransformer", transformer)

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        """Latents ``[B, C, h, w]`` as ``[B, h w, C]`` tokens with their grid (``img_shapes``, one frame), the text
        trimmed to the batch's longest prompt (its mask dropped when nothing is padded; meta tensors, the planner's
        shapes, keep every token, unmasked), ``img_mask`` marking the image's ``h w / 4`` vision slots after the
        text, time ``(1000 sigma) / 1000``. (``velocity`` gives each call rows of one prompt length.)"""
        b, _, h, w = x.shape
        if h % 2 or w % 2:
            raise ValueError(f"Qwen-Image 2.1 latents need an even height and width (resolutions of 32 px multiples), "
                             f"got {tuple(x.shape)}")
        pe, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]  # [B, L, D], [B, L]
        if mask.device.type == "meta":
            mask = None
        else:
            keep = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1  # the batch's longest prompt
            pe, mask = pe[:, :keep], mask[:, :keep]  # [B, n, D], [B, n]
            mask = None if bool(mask.all()) else mask.to(x.device)
        n = pe.shape[1]
        img_mask = torch.cat([torch.zeros(b, n, dtype=torch.bool, device=x.device),
                              torch.ones(b, h * w // 4, dtype=torch.bool, device=x.device)], 1)  # [B, n + hw/4]
        return dict(hidden_states=flatten_latents(x).to(dtype), encoder_hidden_states=pe.to(x.device, dtype),
                    encoder_hidden_states_mask=mask, timestep=sigma * 1000.0 / 1000.0, img_shapes=[[(1, h, w)]] * b,
                    img_mask=img_mask, return_dict=False)  # hidden_states [B, hw, C]

    @classmethod
    def transformer_output(cls, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The joint sequence's last ``h w`` tokens (the image's) as ``[B, C, h, w]``."""
        h, w = x.shape[-2:]
        return unflatten_latents(out[:, -h * w:], h, w)  # [B, C, h, w]

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                "context_in_dim": 16, "axes_dims_rope": (4, 6, 6)}

    @classmethod
    def tiny_components(cls, kind: str = "qwen-image-2.1", image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """A tiny ``QwenImage21Pipeline``: the published transformer shrunk (:meth:`shrink_config`: 2 blocks of 2
        heads of 16, 64 latent channels, MLP ratio 3, causal_condition), an ``AutoencoderKLQwenImage21`` with its
        layout (RGBA, 64 channels, 16x: four downsampling stages; its latent mean / std) at width 4, a 2-layer
        ``Qwen3VLForConditionalGeneration`` 16 wide (:func:`tiny_qwen3_vl`), a ``Qwen3VLProcessor`` over
        ``build_qwen_tokenizer`` with a Qwen3-VL chat template (the pipeline derives the system tokens it drops
        from it), and the published scheduler config."""
        from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
        from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

        tok = build_qwen_tokenizer()
        processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                  min_pixels=32 * 32, max_pixels=64 * 64),
            tokenizer=tok, video_processor=Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
            chat_template=QWEN3_VL_CHAT_TEMPLATE)
        torch.manual_seed(seed)
        text_encoder = tiny_qwen3_vl("Qwen3VLForConditionalGeneration", tok, 2, tie_word_embeddings=False)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=64, dim_mult=[1, 1, 1, 1, 1],
                                       num_res_blocks=1, temperal_downsample=[False, True, True, True])
        torch.manual_seed(seed + 2)
        transformer = QwenImage21Transformer2DModel(**cls.shrink_config(QWEN_IMAGE21_7B))
        scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE21_SCHEDULER)
        return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor,
                    transformer=transformer)

    # --- FlowPolicy ----------------------------------------------------------------------
    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pe, mask, _ = self.pipe.encode_prompt(list(prompts), device=self.device)  # [B, n, D], [B, n] or None
        n = self.max_sequence_length
        return pad_text(pe[:, :n], None if mask is None else mask[:, :n], n)

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning: Qwen3-VL ``prompt_embeds`` [B, max_sequence_length, D] (each prompt's tokens,
        zero padded) and ``prompt_embeds_mask`` [B, max_sequence_length] (1 = token); with CFG also the cached
        ``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``."""
        return super().encode_prompts(prompts)

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, pe: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity for rows ``x`` ``[B, C, h, w]``: each set of rows with one prompt length in its
        own call (module doc), the results in row order."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(mask.sum(1).tolist()):
            groups.setdefault(int(n), []).append(i)
        if len(groups) <= 1:
            return super()._forward(x, sigma, pe, mask)
        parts, order = [], []
        for rows in groups.values():
            idx = torch.tensor(rows, dtype=torch.long)
            parts.append(super()._forward(x[idx.to(x.device)], sigma[idx.to(sigma.device)], pe[idx.to(pe.device)],
                                          mask[idx.to(mask.device)]))  # [b, C, h, w]
            order += rows
        back = torch.argsort(torch.tensor(order)).to(x.device)  # concatenated groups -> row order
        return torch.cat(parts)[back]  # [B, C, h, w]

    def velocity(self, latents: torch.Tensor, sigma, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 ``[B, C, h, w]``; ``sigma`` in [0, 1]. With CFG (``guidance_scale > 1``)
        ``u + s (c - u)`` from two calls (the unconditional one without gradient when ``cfg_uncond_grad`` is off).
        Differentiable in the transformer's parameters."""
        x = latents.to(self.device)  # [B, C, h, w]
        if x.shape[0] == 0:  # no rows (an update's empty minibatch)
            return x.float()
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(x.shape[0])  # [B]
        c = self._forward(x, sigma, *(cond[k] for k in self.cond_keys))  # [B, C, h, w]
        if self.cfg_scale == 1.0:
            return c.float()
        negative = [cond["negative_" + k] for k in self.cond_keys]
        if torch.is_grad_enabled() and not self.cfg_uncond_grad:
            with torch.no_grad():
                u = self._forward(x, sigma, *negative)
        else:
            u = self._forward(x, sigma, *negative)
        return cfg_combine(u, c, self.cfg_scale, uncond_grad=self.cfg_uncond_grad)  # [B, C, h, w]

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """Exactly the sigmas the pipeline gives its scheduler at this resolution: its configured ``sample_sigmas``
        (a fixed grid of that many steps), else ``linspace(1, 1/T, T)``; ``mu`` from the image's tokens."""
        grid = self.pipe.config.get("sample_sigmas")
        if grid is not None and num_steps != len(grid):
            raise ValueError(f"this Qwen-Image 2.1 checkpoint samples on its fixed grid of {len(grid)} sigmas "
                             f"(sample_sigmas in its model_index.json): set sampler.num_steps={len(grid)}, or pass "
                             f"model.options.shift for flowrl's static-shift schedule")
        return qwen_pipeline_sigmas(self.pipe.scheduler, self.image_seq_len, num_steps, grid)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 64, h, w]`` -> float32 RGB images ``[B, 3, 16 h, 16 w]`` in [0, 1]
        (:func:`rgba_vae_decode`)."""
        return rgba_vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, H, W]


def __getattr__(name: str):
    """``QwenImage21PlanTransformer`` (:func:`plan_transformer_class`), built on first use: diffusers loads lazily."""
    if name == "QwenImage21PlanTransformer":
        return plan_transformer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["QWEN3_VL_8B", "QWEN_IMAGE21_7B", "QWEN_IMAGE21_LORA_TARGET_MODULES", "QWEN_IMAGE21_SCHEDULER",
           "QWEN_IMAGE21_VAE", "QwenImage21Policy", "flatten_latents", "plan_transformer_class", "rgba_vae_decode",
           "unflatten_latents"]
