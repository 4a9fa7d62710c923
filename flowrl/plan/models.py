"""The recipe's models built on the meta device (no weights, no download) and their sizes in bytes.

:func:`meta_components` returns the transformer (LoRA added as the trainer adds it), the frozen
text encoders and the VAE, each on ``torch.device("meta")`` in the dtype the recipe loads it in
(``model.options.dtype``: a name, or ``{default: ..., vae: ...}`` per component). Configs come
from :data:`flowrl.plan.specs.HUB_MODELS` for a hub id, or from the ``*/config.json`` files of a
local diffusers directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..bench.precision_arch_models import build_transformer
from ..errors import ConfigError
from .specs import HUB_MODELS, ModelSpec, TextEncoderSpec

FAMILIES = {"sd3": "SD3Transformer2DModel", "flux": "FluxTransformer2DModel"}


@dataclass
class MetaComponents:
    """Meta-device models of one recipe and what the activation passes need to know."""

    family: str
    transformer: nn.Module
    text_encoders: dict[str, nn.Module]
    vae: nn.Module
    dtypes: dict[str, torch.dtype]  # transformer / text_encoder / vae
    source: str
    config: dict  # the transformer's config (published or read from disk)
    build: Callable[[dict], nn.Module]  # config -> a meta transformer set up as ``transformer`` (LoRA or not)


def component_dtype(dtype_option, name: str) -> torch.dtype:
    """The dtype ``from_pretrained`` gives component ``name`` under ``model.options.dtype``."""
    from ..pipelines.common import resolve_dtype

    if dtype_option is None:
        return torch.float32
    try:
        d = resolve_dtype(dtype_option)
    except ValueError as e:
        raise ConfigError(f"model.options.dtype: {e}") from None
    if isinstance(d, dict):
        return d.get(name, d.get("default", torch.float32))
    return d


def module_bytes(module: nn.Module, trainable: Optional[bool] = None) -> int:
    """Bytes of the parameters (all, or only the trainable / frozen ones) plus, for all or frozen, the buffers."""
    ps = [p for p in module.parameters() if trainable is None or p.requires_grad == trainable]
    total = sum(p.numel() * p.element_size() for p in ps)
    if trainable is not True:
        total += sum(b.numel() * b.element_size() for b in module.buffers())
    return total


def num_params(module: nn.Module, trainable: Optional[bool] = None) -> int:
    return sum(p.numel() for p in module.parameters() if trainable is None or p.requires_grad == trainable)


def _strip(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def local_spec(path: Path, pipeline: str) -> ModelSpec:
    """A :class:`ModelSpec` read from a local diffusers directory (``model_index.json`` + configs)."""
    index = json.loads((path / "model_index.json").read_text())
    tr_cls = index.get("transformer", [None, None])[1]
    family = {v: k for k, v in FAMILIES.items()}.get(tr_cls)
    if family is None:
        raise ConfigError(f"{path}: transformer class {tr_cls!r} is not one flowrl plan knows "
                          f"({', '.join(FAMILIES.values())})")
    tes = {}
    for name, entry in index.items():
        if name.startswith("text_encoder") and entry and entry[0] == "transformers":
            raw = json.loads((path / name / "config.json").read_text())
            config_cls = "T5Config" if "T5" in entry[1] else "CLIPTextConfig"
            tes[name] = TextEncoderSpec(entry[1], config_cls, _strip(raw))
    return ModelSpec(family, _strip(json.loads((path / "transformer" / "config.json").read_text())), tes,
                     _strip(json.loads((path / "vae" / "config.json").read_text())), str(path))


def model_spec(path: Optional[str], pipeline: str) -> ModelSpec:
    """The spec of ``model.path``: a local diffusers directory, or a hub id of :data:`HUB_MODELS`."""
    if pipeline not in FAMILIES:
        raise ConfigError(f"flowrl plan covers the sd3 and flux pipelines, not model.pipeline={pipeline!r}")
    p = Path(str(path or "")).expanduser()
    if path and (p / "model_index.json").is_file():
        return local_spec(p, pipeline)
    if path in HUB_MODELS:
        spec = HUB_MODELS[path]
        if spec.family != pipeline:
            raise ConfigError(f"model.path {path} is a {spec.family} model but model.pipeline is {pipeline}")
        return spec
    raise ConfigError(f"model.path {path!r}: not a local diffusers directory (no model_index.json) and not a hub id "
                      f"flowrl plan has published configs for ({', '.join(HUB_MODELS)}); pass one of those, or a "
                      f"directory written by save_pretrained / `flowrl make-tiny {pipeline} DIR`")


def _text_encoder(spec: TextEncoderSpec, dtype: torch.dtype) -> nn.Module:
    import transformers

    config = getattr(transformers, spec.config_cls)(**spec.config)
    with torch.device("meta"):
        model = getattr(transformers, spec.cls)(config)
    return model.to(dtype)


def _vae(config: dict, dtype: torch.dtype) -> nn.Module:
    from diffusers import AutoencoderKL

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            vae = AutoencoderKL(**config)
    finally:
        torch.set_default_dtype(prev)
    return vae.eval().requires_grad_(False)


def set_up_trained(transformer: nn.Module, cfg) -> nn.Module:
    """``transformer`` set up as the trainer sets it up (:func:`flowrl.trainable.set_up_trainable`): the
    recipe's LoRA (its targets, else the pipeline's) or, at ``train.lora_rank: 0``, every weight trained."""
    from ..pipelines import policy_class
    from ..trainable import set_up_trainable

    return set_up_trainable(transformer, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_targets,
                            policy_class(cfg.model.pipeline).lora_target_modules)


def meta_components(cfg, with_text_encoders: bool = True) -> MetaComponents:
    """The recipe ``cfg``'s transformer (with the trainer's LoRA, or all weights trainable), text
    encoders and VAE on the meta device (module doc)."""
    spec = model_spec(cfg.model.path, cfg.model.pipeline)
    opt = cfg.model.options.get("dtype")
    dtypes = {k: component_dtype(opt, k) for k in ("transformer", "text_encoder", "vae")}

    def build(config: dict) -> nn.Module:
        return set_up_trained(build_transformer(spec.family, config, torch.device("meta"), dtypes["transformer"]), cfg)

    tr = build(spec.transformer)
    tes = {}
    if with_text_encoders:
        tes = {name: _text_encoder(s, component_dtype(opt, name)) for name, s in spec.text_encoders.items()}
    return MetaComponents(spec.family, tr, tes, _vae(spec.vae, dtypes["vae"]), dtypes, spec.source,
                          dict(spec.transformer), build)


def block_bytes(transformer: nn.Module) -> int:
    """Bytes of the largest transformer block (what FSDP unshards at once, one block per unit)."""
    sizes = [module_bytes(b) for name in ("transformer_blocks", "single_transformer_blocks")
             for b in getattr(transformer, name, [])]
    return max(sizes, default=module_bytes(transformer))
