"""``DiffusersPolicy``: the base class of the adapters over a diffusers pipeline (every shipped adapter but
``digits``: SD3, FLUX, SANA, Qwen-Image, FLUX.1 Kontext, Wan).

An adapter subclasses it and **declares** what flowrl needs to know about its model, as class
attributes and class methods; nothing about a model lives in tables elsewhere (``flowrl export``,
``flowrl make-tiny``, ``flowrl plan``, ``flowrl bench precision --pipeline NAME-arch`` and the
trainer ask the adapter through ``flowrl.pipelines.policy_class``). Adding a model to every verb
is one adapter file plus one line in ``flowrl.pipelines.REGISTRY``.

Loading, export and tiny models:

==========================  =====================================================================
``kind``                    the pipeline name in ``flowrl.pipelines.REGISTRY``
``pipeline_class``          diffusers pipeline class name: loads the model, saves it, and (by
                            default) writes and loads the exported LoRA (``save_lora_weights`` /
                            ``load_lora_weights``)
``transformer_class``       diffusers class name of ``.transformer`` (export reads its config;
                            plan and the architecture benchmark build it from a config)
``lora_target_modules``     default LoRA targets (peft suffix patterns of the transformer)
``text_encoder_names``      pipeline attributes that are frozen text encoders
``tiny_kinds``              the ``flowrl make-tiny`` kinds this adapter builds offline
``tiny_components(kind,..)``  the components of a tiny random-weight pipeline of that kind
``_encode(prompts, negative)``  named batch-first text conditioning from the pipeline's encoder
``cond_keys``               the conditioning entries the transformer call takes, in order
``velocity`` / ``sigmas``   the model-specific math (``FlowPolicy``)
``cfg_scale_for(sigma, n)`` the CFG scale per row (default ``cfg_scale``; Wan2.2: per expert)
``lora_parts(tensors)``     optional: ``[(component, file, tensors)]``, one exported LoRA file per
                            trained pipeline component (Wan2.2's two experts); default one file
``load_exported_lora(..)``  how an exported file loads into a ``pipeline_class`` instance (default
                            its ``load_lora_weights``; HunyuanImage: the transformer's
                            ``load_lora_adapter``, its pipeline has no LoRA loader)
==========================  =====================================================================

Model facts (``pipelines/facts.py``, class ``ModelFacts``: the defaults fit an MMDiT with an
``AutoencoderKL``; no weights are read, so ``flowrl plan`` needs no download):

=================================================  ==================================================
``published``                                      hub id -> ``ModelConfigs(transformer={...},
                                                   text_encoders={attr: Component("transformers:Cls",
                                                   {...})}, vae=Component("diffusers:Cls", {...}),
                                                   source, title, arch)``: the repository's own
                                                   ``*/config.json`` values; ``arch`` names the
                                                   ``bench precision --pipeline NAME-arch`` entry
``model_configs(path)``                            a local directory's configs (``model_index.json``)
                                                   or a ``published`` entry
``vae_factor(configs)``                            pixels per latent pixel
``latent_channels(transformer_config)``            channels of the policy's latents
``patch_size(transformer_config)``                 transformer patch (resolution multiple = factor x patch)
``default_resolution(configs)``                    image side when no recipe or ``flowrl.json`` sets one
``text_tokens(options)``                           sequence-conditioning tokens under ``model.options``
``geometry(configs, options)``                     ``Geometry(height, width, latent_shape, text_tokens,
                                                   frames)``: override for video (``(C, F, h, w)``)
``vae_latents(latents)``                           the latents as the VAE decodes them (identity;
                                                   a video VAE decoding images adds a frame axis)
``example_conditioning(configs, geometry, rows,    empty tensors shaped as ``encode_prompts``' output
device, dtype)``                                   (the ``cond_keys``)
``cfg_rows(guidance_scale, options)``              rows per sample of a guided sampling forward (1/2)
``transformer_component(config, options)``        the trained transformer as a ``Component`` to build
                                                   (default the ``transformer_class``; Wan2.2: two experts)
``transformer_inputs(config, dtype, x, sigma,      the transformer's forward kwargs; the adapter's own
cond, **settings)``                                velocity calls it, so plan and bench run the same
``transformer_output(out, x)``                     the forward's output as a velocity shaped like ``x``
``block_counts(config)`` / ``with_block_counts``   blocks per block type (the planner's depth probes)
``shrink_config(config)``                          a toy-size config of the same architecture
                                                   (``bench precision --tiny`` on a CPU)
``context_parallel_refusal``                       why the transformer's diffusers ``_cp_plan`` does not
                                                   run ("" = it does; LTX-2): ``train.context_parallel``
                                                   > 1 refused when the config loads
=================================================  ==================================================

A reward's resident size is declared on the reward class (``resident_params``, ``resident_note``:
see ``flowrl.rewards``); the planner reports a reward without it as unknown.

The base provides the rest: ``from_pretrained`` / ``save_pretrained`` (with the ``flowrl.json``
resolution default), freezing everything but the transformer, the cached negative-prompt
conditioning, resolution checks, the guided ``velocity`` over ``transformer_inputs``, ``decode``,
``initial_noise``, the export writer and ``make_tiny``. Model-independent adapters (the digits
model) inherit ``ModelFacts`` and declare the same attributes by hand.
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import ClassVar, Optional, Sequence, Union

import torch

from flowrl.options import PositiveInt, check_value, declared
from flowrl.schedules import flow_sigmas
from flowrl.seeding import seeded_randn
from flowrl.utils.io import atomic_dir, write_json

from .common import (DECODE_BATCH, DTypeArg, Resolution, cfg_combine, cfg_halves, check_model_path, resolve_dtype,
                     resolve_resolution, transformer_dtype, vae_decode, vae_encode)
from .facts import ModelFacts

FLOWRL_JSON = "flowrl.json"
IMAGE_SIZE = 64  # pixels: the default tiny resolution
def read_flowrl_json(path: Union[str, os.PathLike]) -> dict:
    """The optional ``flowrl.json`` defaults of a local model directory ({} if absent)."""
    p = Path(os.path.expanduser(str(path))) / FLOWRL_JSON
    if p.is_file():
        return json.loads(p.read_text())
    return {}


def write_atomically(out_dir: Union[str, os.PathLike], write, *, overwrite: bool = False) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``out_dir`` and rename it into place, so a
    crash leaves no half-written model. ``out_dir`` must be absent or empty unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it")
    return atomic_dir(out, write)


def encode_with_negative(adapter, prompts: list[str], use_negative: bool) -> dict[str, torch.Tensor]:
    """Batch-first conditioning ``adapter._encode(prompts)`` (a dict of named tensors, or the
    ``(prompt_embeds, pooled_prompt_embeds)`` pair); with ``use_negative`` also ``negative_<name>``
    for each: the adapter's ``negative_prompt``, encoded once (cached in ``adapter._negative``) and
    repeated per row. No gradients: the text encoders are frozen."""
    prompts = list(prompts)
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {i} is {type(p).__name__}, expected str")

    def named(out) -> dict[str, torch.Tensor]:
        return out if isinstance(out, dict) else {"prompt_embeds": out[0], "pooled_prompt_embeds": out[1]}

    with torch.no_grad():
        cond = named(adapter._encode(prompts))
        if use_negative:
            if adapter._negative is None:
                kw = {"negative": True} if "negative" in inspect.signature(adapter._encode).parameters else {}
                neg = named(adapter._encode([adapter.negative_prompt], **kw))
                adapter._negative = {f"negative_{k}": v for k, v in neg.items()}  # [1, ...] each
            b = len(prompts)
            cond.update({k: v.repeat(b, *([1] * (v.ndim - 1))) for k, v in adapter._negative.items()})
    return cond


def diffusers_attr(name: str):
    """``diffusers.<name>``, or ``diffusers.loaders.<name>`` (the LoRA loader mixins live there)."""
    import diffusers

    obj = getattr(diffusers, name, None)
    if obj is None:
        from diffusers import loaders

        obj = getattr(loaders, name)
    return obj


def _diffusers_loading(*, revision: Optional[str] = None, variant: Optional[str] = None,
                       cache_dir: Optional[str] = None, use_safetensors: Optional[bool] = None,
                       low_cpu_mem_usage: bool = True) -> None:
    """The keywords of diffusers' ``DiffusionPipeline.from_pretrained`` an adapter passes through (its
    ``loading_options``): a hub revision, a weights variant (``fp16``), a cache directory, ..."""


class TransformerLoraExport:
    """For an adapter whose diffusers pipeline has no LoRA loader (diffusers 0.42.1: HunyuanImage, HunyuanVideo
    1.5): the export is written in diffusers' LoRA format (keys ``transformer.*``, the ``LoraConfig`` as metadata)
    by the Hunyuan video pipeline's mixin, and loads into the pipeline's transformer (``load_lora_adapter``). Put
    it before :class:`DiffusersPolicy` in the adapter's bases."""

    pipeline_class: ClassVar[str] = ""

    @classmethod
    def lora_writer(cls):
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    @classmethod
    def lora_load_hint(cls, components=None) -> str:
        return (f"{cls.pipeline_class}.from_pretrained(BASE).transformer.load_lora_adapter(OUT, "
                f"weight_name='pytorch_lora_weights.safetensors', prefix='transformer')")

    @classmethod
    def load_exported_lora(cls, pipe, out_dir, weight_name: str = "pytorch_lora_weights.safetensors",
                           component: str = "transformer") -> None:
        """``load_lora_adapter`` on the pipeline's transformer (the pipeline has no ``load_lora_weights``)."""
        getattr(pipe, component).load_lora_adapter(str(out_dir), weight_name=weight_name, prefix="transformer")


class DiffusersPolicy(ModelFacts):
    """Base ``FlowPolicy`` over a diffusers pipeline; see the module doc for what a subclass declares."""

    loading_options = declared(_diffusers_loading)[0]

    pipeline_class: ClassVar[str] = ""
    lora_target_modules: ClassVar[Sequence[str]] = ()
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    tiny_kinds: ClassVar[tuple[str, ...]] = ()
    example_hub_id: ClassVar[str] = ""  # named in the missing-path error
    tiny_num_frames: ClassVar[Optional[int]] = None  # video adapters: the tiny model's default length (flowrl.json)
    # with CFG in a differentiable forward: gradient through the unconditional half too (True), or that
    # half without gradient (False, Flow-GRPO's training forward); the trainer sets train.loss_options.cfg_uncond_grad
    cfg_uncond_grad: bool = True
    # token sequences a transformer call gets must be a multiple of this (the run's context-parallel degree: each
    # process takes an equal slice); the trainer sets it from the run's layout, an adapter never reads it off a module
    token_multiple: int = 1

    # --- declarations with defaults ---------------------------------------------------------
    @classmethod
    def lora_writer(cls):
        """The diffusers class whose ``save_lora_weights`` writes the exported LoRA (the pipeline)."""
        return diffusers_attr(cls.pipeline_class)

    @classmethod
    def lora_load_hint(cls) -> str:
        """How a user loads the export (``BASE`` / ``OUT`` are filled in by ``flowrl export``)."""
        return f"{cls.pipeline_class}.from_pretrained(BASE).load_lora_weights(OUT)"

    @classmethod
    def load_exported_lora(cls, pipe, out_dir, weight_name: str = "pytorch_lora_weights.safetensors",
                           component: str = "transformer") -> None:
        """Load one file of a ``flowrl export`` LoRA into ``pipe`` (a ``pipeline_class`` instance) as a user would
        (:meth:`lora_load_hint`): the pipeline's ``load_lora_weights``, a second trained transformer's file with
        ``load_into_<component>=True``. An adapter whose pipeline has no LoRA loader overrides it."""
        pipe.load_lora_weights(str(out_dir), weight_name=weight_name,
                               **({} if component == "transformer" else {f"load_into_{component}": True}))

    @classmethod
    def tiny_components(cls, kind: str, image_size: int = IMAGE_SIZE, seed: int = 0) -> dict:
        """Keyword arguments of ``pipeline_class`` for a tiny random-weight model of ``kind``."""
        raise NotImplementedError(f"{cls.__name__} declares no tiny components")

    @classmethod
    def tiny_multiple(cls) -> int:
        """Tiny image sizes must be multiples of this many pixels."""
        return 16

    # --- construction ------------------------------------------------------------------------
    def _setup(self, pipe, device: Union[str, torch.device]) -> None:
        """Move ``pipe`` to ``device``, keep its transformer trainable and freeze the VAE and text encoders."""
        self.device = torch.device(device)
        self.pipe = pipe.to(self.device)
        self.transformer = pipe.transformer
        self.vae = pipe.vae.requires_grad_(False).eval()
        for name in self.text_encoder_names:
            te = getattr(pipe, name, None)
            if te is not None:
                te.requires_grad_(False).eval()
        self.pipe.set_progress_bar_config(disable=True)
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self.lora_target_modules = list(type(self).lora_target_modules)
        self._negative: Optional[dict[str, torch.Tensor]] = None  # cached [1, ...] negative conditioning
        self.decode_batch: Optional[int] = DECODE_BATCH  # images per VAE call (from_pretrained's decode_batch)

    def _keep_options(self, *, guidance_scale: float, negative_prompt: str, max_sequence_length: int,
                      shift: Optional[float], schedule: str, **own) -> None:
        """Check the options every adapter takes, and ``own`` options of the adapter, against its declaration
        (:meth:`declared_options`: the annotated ``__init__`` parameters; a ``ValueError`` naming the option) and
        record them as attributes (numbers as float / int)."""
        options = type(self).declared_options()
        values = dict(guidance_scale=guidance_scale, negative_prompt=negative_prompt,
                      max_sequence_length=max_sequence_length, shift=shift, schedule=schedule, **own)
        for name, value in values.items():
            check_value(name, options[name], value)
        self.guidance_scale = float(guidance_scale)
        self.negative_prompt = str(negative_prompt)
        self.max_sequence_length = int(max_sequence_length)
        self.shift = None if shift is None else float(shift)
        self.schedule = schedule
        for name, value in own.items():
            setattr(self, name, value)

    def _image_geometry(self, resolution: Resolution, default: int, channels: int) -> None:
        """``height`` / ``width`` (multiples of 2 x the VAE factor: a patch of 2), ``latent_shape`` ``(channels,
        H / f, W / f)`` and ``image_seq_len``, the patch-2 tokens per image."""
        f = self.vae_scale_factor
        self.height, self.width = resolve_resolution(resolution, default, 2 * f)
        h, w = self.height // f, self.width // f
        self.latent_shape = (int(channels), h, w)  # (C, h, w)
        self.image_seq_len = (h // 2) * (w // 2)

    @classmethod
    def from_pretrained(cls, path_or_id: Union[str, os.PathLike], *, dtype: DTypeArg = torch.float32,
                        resolution: Resolution = None, gradient_checkpointing: bool = False,
                        decode_batch: Optional[PositiveInt] = DECODE_BATCH, **kwargs):
        """Load with ``<pipeline_class>.from_pretrained(path_or_id, dtype=dtype, **pipeline_kwargs)``.

        ``kwargs`` naming an ``__init__`` argument of the adapter go to the adapter, the rest to
        diffusers. ``dtype`` may be a name (``"bfloat16"``) or a per-component dict (``{"default":
        "bfloat16", "vae": "float32"}``), as YAML recipes give it. ``gradient_checkpointing``
        recomputes the transformer's block activations in the backward pass (less memory, ~30%
        slower updates). A local directory may hold a ``flowrl.json`` (written by ``flowrl
        make-tiny``) whose ``resolution`` is the default when ``resolution`` is None. ``decode_batch``:
        images per VAE call in :meth:`decode` (None: the whole batch at once). Other options
        ``flowrl.json`` records (:meth:`saved_options`, e.g. Wan's ``num_frames``) are the defaults of
        the adapter arguments left None. Every option is checked against :meth:`declared_options` first (the
        pipeline's text encoders may be given as components, e.g. None: not loaded).
        """
        cls.check_options({"dtype": dtype, "resolution": resolution, "gradient_checkpointing": gradient_checkpointing,
                           "decode_batch": decode_batch,
                           **{k: v for k, v in kwargs.items() if k not in cls.text_encoder_names}},
                          kwargs.get("guidance_scale"), where="")
        if path_or_id is None or str(path_or_id) == "":
            raise ValueError(f"pass a model directory or hub id (`flowrl make-tiny {cls.kind} DIR` writes a "
                             f"tiny offline one)")
        check_model_path(str(path_or_id), cls.kind, cls.example_hub_id or None, kwargs.get("cache_dir"))
        saved = read_flowrl_json(path_or_id)
        if resolution is None:
            resolution = saved.get("resolution")
        own = set(inspect.signature(cls.__init__).parameters) - {"self", "pipe"}
        kwargs.update({k: v for k, v in saved.items()
                       if k in own and k != "resolution" and kwargs.get(k) is None})  # saved_options
        policy_kw = {k: v for k, v in kwargs.items() if k in own}
        pipeline_kw = {k: v for k, v in kwargs.items() if k not in own}
        pipe = diffusers_attr(cls.pipeline_class).from_pretrained(str(path_or_id), dtype=resolve_dtype(dtype),
                                                                  **pipeline_kw)
        if gradient_checkpointing:
            pipe.transformer.enable_gradient_checkpointing()
        policy = cls(pipe, resolution=resolution, **policy_kw)
        policy.decode_batch = decode_batch
        return policy

    def saved_options(self) -> dict:
        """Adapter arguments ``save_pretrained`` records in ``flowrl.json`` besides the resolution: the
        defaults when the model is loaded back (video adapters, those declaring ``tiny_num_frames``:
        ``num_frames``; none otherwise)."""
        return {} if self.tiny_num_frames is None else {"num_frames": self.num_frames}

    @classmethod
    def tiny_options(cls, kind: str) -> dict:
        """Adapter arguments ``make_tiny`` records in ``flowrl.json`` besides the resolution (video adapters:
        their ``tiny_num_frames``; none otherwise)."""
        return {} if cls.tiny_num_frames is None else {"num_frames": cls.tiny_num_frames}

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """Save the whole pipeline (with the current ``self.transformer``) as a diffusers directory, and
        ``flowrl.json`` (kind, resolution, :meth:`saved_options`) written once, atomically."""
        self.pipe.transformer = self.transformer
        self.pipe.save_pretrained(str(path))
        write_json({"kind": self.kind, "resolution": [self.height, self.width], **self.saved_options()},
                   Path(path) / FLOWRL_JSON)

    @classmethod
    def tiny_image_size(cls, default: int) -> int:
        """Pixels per side of this adapter's tiny model in a smoke run: ``default`` (any size builds)."""
        return default

    @classmethod
    def make_tiny(cls, kind: str, out_dir: Union[str, os.PathLike], *, image_size: int = IMAGE_SIZE, seed: int = 0,
                  overwrite: bool = False) -> Path:
        """Write a tiny random-weight pipeline of ``kind`` (one of ``tiny_kinds``) to ``out_dir`` with
        ``save_pretrained``, offline and deterministic in ``seed``; ``image_size`` (pixels) is
        recorded in ``flowrl.json`` as the adapter's default resolution."""
        if kind not in cls.tiny_kinds:
            raise ValueError(f"{cls.__name__} builds tiny kinds {', '.join(cls.tiny_kinds)}, not {kind!r}")
        m = cls.tiny_multiple()
        if image_size % m or image_size < m:
            raise ValueError(f"image_size must be a positive multiple of {m} for {kind}, got {image_size}")
        pipe = diffusers_attr(cls.pipeline_class)(**cls.tiny_components(kind, image_size, seed))

        def write(tmp: Path) -> None:
            pipe.save_pretrained(tmp)
            (tmp / FLOWRL_JSON).write_text(json.dumps({"kind": kind, "resolution": image_size, "tiny": True,
                                                       **cls.tiny_options(kind)}, indent=2))

        return write_atomically(out_dir, write, overwrite=overwrite)

    # --- FlowPolicy (shared parts) -----------------------------------------------------------
    @property
    def cfg_scale(self) -> float:
        """The real classifier-free guidance scale (1.0: none, one pass)."""
        return getattr(self, "guidance_scale", 1.0)

    @property
    def uses_negative(self) -> bool:
        """Whether ``encode_prompts`` adds the negative prompt's conditioning (real CFG is on)."""
        return self.cfg_scale > 1.0

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first conditioning from ``_encode``; with CFG also the cached ``negative_*`` tensors."""
        return encode_with_negative(self, prompts, use_negative=self.uses_negative)

    def forward_settings(self) -> dict:
        """The adapter's knobs ``transformer_inputs`` takes (e.g. FLUX's embedded ``guidance_scale``)."""
        return {}

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, *entries: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity (its dtype) for latents ``x`` ``[B, *latent_shape]`` (images ``[B, C, h,
        w]``, videos ``[B, C, F', h, w]``), ``sigma`` [B] and the
        ``cond_keys`` entries, through ``transformer_inputs`` / ``transformer_output``."""
        config = getattr(self.transformer, "module", self.transformer).config  # also under a DDP wrapper
        kw = self.transformer_inputs(config, transformer_dtype(self.transformer), x, sigma,
                                     dict(zip(self.cond_keys, entries)), **self.forward_settings())
        return self.transformer_output(self.transformer(**kw)[0], x)

    def velocity(self, latents: torch.Tensor, sigma, cond) -> torch.Tensor:
        """``v_theta(x_t, sigma)`` float32 shaped like the latents (``[B, C, h, w]``, or ``[B, C, F', h, w]``
        for a video model) through ``self._forward`` with the entries
        ``cond_keys``; with guidance (``cfg_scale > 1``), ``u + s (c - u)`` (``pipelines.common.cfg_halves``:
        one doubled batch, or in a differentiable forward with ``cfg_uncond_grad`` off the unconditional half alone
        under ``no_grad``). Differentiable in the transformer's parameters."""
        x = latents.to(self.device)  # [B, C, (F',) h, w]
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        text = (x, sigma, *(cond[k] for k in self.cond_keys))
        if self.cfg_scale == 1.0:
            return self._forward(*text).float()
        uncond = (x, sigma, *(cond["negative_" + k] for k in self.cond_keys))
        u, c = cfg_halves(self._forward, uncond, text, uncond_grad=self.cfg_uncond_grad)  # [B, C, (F',) h, w] each
        return cfg_combine(u, c, self.cfg_scale_for(sigma, x.ndim), uncond_grad=self.cfg_uncond_grad)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``[num_steps + 1]`` float32 from 1 to 0: ``flow_sigmas(num_steps, shift, schedule)`` with a static
        ``shift`` (SD3, SANA and Wan resolve theirs from the scheduler), else exactly what the pipeline gives
        its scheduler (:meth:`pipeline_sigmas`)."""
        if self.shift is not None:
            return flow_sigmas(num_steps, self.shift, self.schedule)
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        return self.pipeline_sigmas(num_steps)

    def pipeline_sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's own ``[num_steps + 1]`` sigmas at this resolution (an adapter whose ``shift`` may be
        None overrides it; :func:`pipelines.common.scheduler_sigmas` runs a copy of the pipeline's scheduler)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no pipeline schedule: pass a static shift")

    def cfg_scale_for(self, sigma: torch.Tensor, ndim: int):
        """The guidance scale of rows at ``sigma`` [B]: ``cfg_scale`` (a float); an adapter whose scale changes
        along the schedule (Wan2.2's ``guidance_scale_2``) returns a float32 tensor ``[B, 1, ...]`` of ``ndim`` dims."""
        return self.cfg_scale

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> float32 images ``[B, 3, f h, f w]`` in [0, 1] (f = VAE factor):
        ``latents / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped. A video model
        overrides it: latents ``[B, C, F', h, w]`` -> videos ``[B, 3, F, H, W]`` (Wan)."""
        return vae_decode(self.vae, latents, self.device, self.decode_batch)  # [B, 3, H, W]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] -> latents ``[B, C, h, w]``, decode's inverse
        (``pipelines.common.vae_encode``): what training on an image dataset needs (``train.loss`` sft,
        dpo_offline). An adapter that decodes its own way (packed or video latents) has none yet."""
        if type(self).decode is not DiffusersPolicy.decode:
            raise NotImplementedError(f"{type(self).__name__} decodes its latents its own way and has no encode(images) "
                                      f"yet")
        return vae_encode(self.vae, images, self.device, self.decode_batch)  # [B, C, h, w]

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        """Standard-normal float32 ``[B, *latent_shape]`` (``[B, C, h, w]``, video ``[B, C, F', h, w]``), row
        i depending only on ``seeds[i]``."""
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, C, (F',) h, w]
