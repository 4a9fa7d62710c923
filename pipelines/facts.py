"""What flowrl knows about a model without its weights: the facts API every adapter class declares.

``flowrl plan`` (meta-device models, activation probes, byte counts) and ``flowrl bench precision
--pipeline NAME-arch`` (the published transformer with random weights) read a model only through
its adapter class (``flowrl.pipelines.policy_class(name)``), which inherits :class:`ModelFacts`
and overrides what differs from the defaults below. The table of names is in ``pipelines/base.py``.

Data:

* :class:`Component`: one component as ``"library:Class"`` plus the keyword config that builds it
  (``"transformers:T5EncoderModel"``, ``"diffusers:AutoencoderKL"``, ``"flowrl.pipelines.digits:
  DigitTextEncoder"``): a ``transformers`` model is built from ``Class.config_class(**config)``,
  anything else as ``Class(**config)``;
* :class:`ModelConfigs`: the transformer config, the frozen text encoders (pipeline attribute ->
  :class:`Component`, any kind) and the VAE of one model, published (copied from the hub
  repository's ``*/config.json``, so nothing is downloaded) or read from a local directory;
* :class:`Geometry`: the per-sample shapes of one set-up (pixels, latents, text tokens, frames).

:func:`build_component` builds any of these on a device (``meta`` for planning) in a dtype.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator, Optional, Union

import torch
from torch import nn

from flowrl.options import Option, check_options, declared


@dataclass(frozen=True)
class Component:
    """A component class (``"library:Class"``; ``diffusers:`` also finds the loader mixins) and its config."""

    cls: str
    config: dict


@dataclass(frozen=True)
class ModelConfigs:
    """The component configs of one model.

    ``transformer``: the trained transformer's config (its class is the adapter's
    ``transformer_class``); ``text_encoders``: pipeline attribute -> frozen text encoder;
    ``vae``: None when the model decodes without one (digits); ``source``: the hub id or directory
    the configs come from; ``title``: a display name; ``arch``: the ``flowrl bench precision
    --pipeline`` name that builds this transformer with random weights (``""``: none).
    """

    transformer: dict
    text_encoders: dict = field(default_factory=dict)
    vae: Optional[Component] = None
    source: str = ""
    title: str = ""
    arch: str = ""


@dataclass(frozen=True)
class Geometry:
    """Per-sample shapes: image ``height`` x ``width`` pixels (``frames`` of them: 1 for images),
    ``latent_shape`` as the policy's latents (``(C, h, w)``, or ``(C, F, h, w)`` for video), and
    ``text_tokens`` of the sequence conditioning."""

    height: int
    width: int
    latent_shape: tuple
    text_tokens: int
    frames: int = 1

    @property
    def latent_bytes(self) -> int:
        """Bytes of one sample's float32 latents."""
        return math.prod(self.latent_shape) * 4

    @property
    def image_bytes(self) -> int:
        """Bytes of one decoded float32 sample ``[3, (F,) H, W]``."""
        return 3 * self.frames * self.height * self.width * 4


def component_class(spec: str) -> type:
    """The class named by ``"library:Class"`` (``diffusers:X`` also looks in ``diffusers.loaders``)."""
    module, _, name = spec.partition(":")
    if module == "diffusers":
        import diffusers

        return getattr(diffusers, name, None) or getattr(importlib.import_module("diffusers.loaders"), name)
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_component(component: Component, device: Union[str, torch.device], dtype: torch.dtype,
                    seed: int = 0) -> nn.Module:
    """``component`` built directly on ``device`` with every floating tensor in ``dtype`` (random
    init, seeded; no copy in another dtype on the way: a 12B FLUX in bf16 needs 24 GB, in fp32 48),
    in eval mode with gradients off."""
    cls = component_class(component.cls)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in component.config.items()}
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        config_class = getattr(cls, "config_class", None)
        model = cls(config_class(**config)) if inspect.isclass(config_class) and component.cls.startswith(
            "transformers:") else cls(**config)
    for m in model.modules():  # tensors created with an explicit dtype (e.g. a float32 position table)
        for store in (m._parameters, m._buffers):
            for k, t in list(store.items()):
                if t is not None and t.is_floating_point() and t.dtype != dtype:
                    # a new tensor, not `t.data = ...`: a view (SD3's table is `table.float().unsqueeze(0)`)
                    # keeps its float32 base alive through `_base` (864 MiB at SD3.5-Medium size)
                    new = t.detach().to(dtype)
                    store[k] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    return model.eval().requires_grad_(False)


def _config_json(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def read_diffusers_dir(path: Union[str, os.PathLike]) -> ModelConfigs:
    """The :class:`ModelConfigs` of a local diffusers directory: ``model_index.json`` names each
    component's library and class, its ``<name>/config.json`` holds the config."""
    root = Path(os.path.expanduser(str(path)))
    index = json.loads((root / "model_index.json").read_text())
    tes = {name: Component(f"{entry[0]}:{entry[1]}", _config_json(root / name / "config.json"))
           for name, entry in index.items() if name.startswith("text_encoder") and entry and entry[0]}
    vae = index.get("vae")
    return ModelConfigs(_config_json(root / "transformer" / "config.json"), tes,
                        Component(f"{vae[0]}:{vae[1]}", _config_json(root / "vae" / "config.json")) if vae else None,
                        str(path), root.name)


class ModelFacts:
    """The facts API: class attributes and class methods an adapter declares (module doc; the
    defaults fit a diffusers MMDiT-style model with an ``AutoencoderKL``)."""

    kind: ClassVar[str] = ""
    transformer_class: ClassVar[str] = ""
    published: ClassVar[dict] = {}  # hub id -> ModelConfigs
    cond_keys: ClassVar[tuple] = ()
    # keywords of the library loader the adapter passes through (name -> Option); the diffusers base: revision, ...
    loading_options: ClassVar[dict] = {}
    # model.options keys another setting owns -> that setting
    options_elsewhere: ClassVar[dict] = {"guidance_scale": "model.guidance_scale", "device": "model.device"}
    smoke_model_options: ClassVar[dict] = {}  # its own `flowrl train --smoke` values of flowrl.smoke.MODEL_OPTIONS keys
    # why train.context_parallel > 1 cannot run on this model although its transformer class declares a diffusers
    # _cp_plan ("" = it can; a transformer without a plan is refused by flowrl.distributed.context.cp_plan)
    context_parallel_refusal: ClassVar[str] = ""

    # --- options ------------------------------------------------------------------------------
    @classmethod
    def declared_options(cls) -> dict[str, Option]:
        """What ``model.options`` may set (:mod:`flowrl.options`): the keyword parameters with defaults of the
        adapter's ``from_pretrained`` and ``__init__``, with their annotated types and ranges, and the
        ``loading_options`` it passes through to its library's loader."""
        loader, _ = declared(cls.from_pretrained)
        init, _ = declared(cls.__init__)
        return {**{k: o for k, o in {**init, **loader}.items() if not o.required}, **cls.loading_options}

    @classmethod
    def check_options(cls, options: dict, guidance_scale: Optional[float] = None, where: str = "model.options") -> None:
        """One ``ValueError`` line for an unknown key, a wrong type or a value out of range in ``options`` (keys
        another setting owns are refused with its name when ``where`` is ``model.options``), then the adapter's
        rules between options (:meth:`check_option_rules`; ``guidance_scale``: ``model.guidance_scale``, None
        when not known). Reads no weights: config validation calls it before anything loads."""
        check_options(where, f"the {cls.kind or cls.__name__!r} model", cls.declared_options(), options,
                      elsewhere=cls.options_elsewhere if where == "model.options" else None)
        cls.check_option_rules(dict(options), guidance_scale)

    @classmethod
    def check_option_rules(cls, options: dict, guidance_scale: Optional[float]) -> None:
        """Rules between this adapter's options (and ``model.guidance_scale``) that need no weights, each a
        ``ValueError`` line naming the keys; none by default."""

    # --- which model ------------------------------------------------------------------------
    @classmethod
    def model_configs(cls, path: Optional[str]) -> ModelConfigs:
        """The configs of ``model.path``: a local diffusers directory, or a hub id of ``published``."""
        p = Path(os.path.expanduser(str(path or "")))
        if path and (p / "model_index.json").is_file():
            configs = read_diffusers_dir(p)
            found = json.loads((p / "model_index.json").read_text()).get("transformer", [None, None])[1]
            if found != cls.transformer_class:
                raise ValueError(f"{path}: its transformer is {found!r}, not the {cls.transformer_class} of "
                                 f"model.pipeline={cls.kind}")
            return configs
        if path in cls.published:
            return cls.published[path]
        known = ", ".join(cls.published) or "none"
        raise ValueError(f"model.path {path!r}: not a local diffusers directory (no model_index.json) and not a "
                         f"hub id with published configs in the {cls.kind} adapter ({known}); pass one of those, or "
                         f"a directory written by save_pretrained / `flowrl make-tiny {cls.kind} DIR`")

    # --- shapes -----------------------------------------------------------------------------
    @classmethod
    def vae_factor(cls, configs: ModelConfigs) -> int:
        """Pixels per latent pixel (an ``AutoencoderKL``: 2 per down block after the first)."""
        return 2 ** (len(configs.vae.config["block_out_channels"]) - 1)

    @classmethod
    def latent_channels(cls, transformer: dict) -> int:
        """Channels of the policy's latents, from the transformer config."""
        return int(transformer["in_channels"])

    @classmethod
    def patch_size(cls, transformer: dict) -> int:
        return int(transformer.get("patch_size") or 1)

    @classmethod
    def default_resolution(cls, configs: ModelConfigs) -> int:
        """Image side (pixels) when neither the recipe nor ``flowrl.json`` gives one."""
        return int(configs.transformer["sample_size"]) * cls.vae_factor(configs)

    @classmethod
    def text_tokens(cls, options: dict) -> int:
        """Tokens of the sequence conditioning under ``model.options`` (default: the adapter's
        ``max_sequence_length`` argument and its default)."""
        params = inspect.signature(cls.__init__).parameters
        if "max_sequence_length" not in params:
            raise NotImplementedError(f"{cls.__name__} declares no text_tokens")
        return int(options.get("max_sequence_length", params["max_sequence_length"].default))

    @classmethod
    def geometry(cls, configs: ModelConfigs, options: dict) -> Geometry:
        """Shapes of one sample at ``options['resolution']`` (int or (H, W); default
        :meth:`default_resolution`), checked against the VAE factor x patch size."""
        from .common import resolve_resolution

        f = cls.vae_factor(configs)
        res = options.get("resolution") or cls.default_resolution(configs)
        h, w = resolve_resolution(res, 0, f * cls.patch_size(configs.transformer))
        return Geometry(h, w, (cls.latent_channels(configs.transformer), h // f, w // f), cls.text_tokens(options))

    @classmethod
    def vae_latents(cls, latents: torch.Tensor) -> torch.Tensor:
        """The policy's latents as its VAE decodes them (the layout ``decode`` passes, the planner's
        decode pass too): unchanged by default; a video VAE decoding images adds a frame axis."""
        return latents

    @classmethod
    def example_conditioning(cls, configs: ModelConfigs, geometry: Geometry, rows: int, device, dtype: torch.dtype
                             ) -> dict[str, torch.Tensor]:
        """Empty tensors of the shapes ``encode_prompts`` returns for ``rows`` prompts without CFG
        (the ``cond_keys``), floating ones in ``dtype``: a sequence ``[rows, L, joint_attention_dim]``
        and a pooled ``[rows, pooled_projection_dim]`` embedding."""
        c = configs.transformer
        return {cls.cond_keys[0]: torch.empty(rows, geometry.text_tokens, c["joint_attention_dim"], device=device,
                                              dtype=dtype),  # [B, L, D]
                cls.cond_keys[1]: torch.empty(rows, c["pooled_projection_dim"], device=device, dtype=dtype)}  # [B, P]

    @classmethod
    def cfg_rows(cls, guidance_scale: float, options: dict) -> int:
        """Rows per sample in a sampling forward: 2 when real classifier-free guidance runs (one doubled batch)."""
        return 2 if guidance_scale > 1.0 else 1

    # --- the transformer call ---------------------------------------------------------------
    @classmethod
    def transformer_component(cls, transformer: dict, options: dict) -> Component:
        """The trained transformer of config ``transformer`` under ``model.options`` as a :class:`Component`
        (plan and bench build it with :func:`build_component`): the ``transformer_class`` by default."""
        return Component("diffusers:" + cls.transformer_class, transformer)

    @classmethod
    def transformer_inputs(cls, config, dtype: torch.dtype, x: torch.Tensor, sigma: torch.Tensor, cond: dict,
                           **settings) -> dict:
        """Keyword arguments of the transformer's forward for latents ``x`` (the policy's layout),
        ``sigma`` float32 ``[B]`` and the ``cond_keys`` entries of ``cond``: what the adapter's own
        velocity passes (``settings``: its knobs, e.g. FLUX's ``guidance_scale``)."""
        raise NotImplementedError(f"{cls.__name__} declares no transformer_inputs")

    @classmethod
    def transformer_output(cls, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The transformer's first output as a velocity in the layout of ``x``."""
        return out

    # --- depth (the planner's reduced-depth probes) -----------------------------------------
    @classmethod
    def block_counts(cls, transformer: dict) -> dict[str, int]:
        """Block count by block type, in forward order (one type: ``num_layers``)."""
        return {"blocks": int(transformer["num_layers"])}

    @classmethod
    def with_block_counts(cls, transformer: dict, counts: dict[str, int]) -> dict:
        """``transformer`` with the block counts ``counts`` (the inverse of :meth:`block_counts`)."""
        return {**transformer, "num_layers": counts["blocks"]}

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        """The published config at toy width and depth (same block types, latent channels and patch
        size): the architecture benchmark's ``--tiny`` code path on a CPU."""
        raise NotImplementedError(f"{cls.__name__} declares no shrink_config")
