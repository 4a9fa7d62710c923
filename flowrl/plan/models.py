"""The recipe's models built on the meta device (no weights, no download) and their sizes in bytes.

:func:`meta_components` returns the transformer (LoRA added as the trainer adds it), the frozen
text encoders and the VAE, each on ``torch.device("meta")`` in the dtype the recipe loads it in
(``model.options.dtype``: a name, or ``{default: ..., vae: ...}`` per component). Every fact about
the model comes from its adapter class (``flowrl.pipelines.policy_class``, ``pipelines/facts.py``):
the configs (published ones for a hub id, the ``*/config.json`` files of a local directory), the
shapes, the transformer call and the block types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..checkpoints.runs import base_model_path
from ..pipelines.facts import ModelConfigs, build_component
from ..errors import ConfigError


@dataclass
class MetaComponents:
    """Meta-device models of one recipe and what the activation passes need to know."""

    adapter: type  # the pipeline's adapter class: its model facts
    transformer: nn.Module
    text_encoders: dict[str, nn.Module]
    vae: Optional[nn.Module]  # None: the model decodes without one
    dtypes: dict[str, torch.dtype]  # transformer / text_encoder / vae
    configs: ModelConfigs
    build: Callable[[dict], nn.Module]  # config -> a meta transformer set up as ``transformer`` (LoRA or not)

    @property
    def config(self) -> dict:
        """The transformer's config (published or read from disk)."""
        return self.configs.transformer

    @property
    def source(self) -> str:
        return self.configs.source


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


def model_configs(cfg) -> tuple[type, ModelConfigs]:
    """The adapter class of ``model.pipeline`` and its configs of ``model.path`` (its ``model_configs``)."""
    from ..pipelines import policy_class

    try:
        adapter = policy_class(cfg.model.pipeline)
        return adapter, adapter.model_configs(base_model_path(cfg.model.path))  # a run directory: its base's
    except (ValueError, NotImplementedError) as e:
        raise ConfigError(str(e)) from None


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
    adapter, configs = model_configs(cfg)
    opt = cfg.model.options.get("dtype")
    dtypes = {k: component_dtype(opt, k) for k in ("transformer", "text_encoder", "vae")}

    def build(config: dict) -> nn.Module:
        comp = adapter.transformer_component(config, cfg.model.options)
        return set_up_trained(build_component(comp, "meta", dtypes["transformer"]), cfg)

    tes = {}
    if with_text_encoders:
        tes = {name: build_component(c, "meta", component_dtype(opt, name))
               for name, c in configs.text_encoders.items()}
    vae = build_component(configs.vae, "meta", dtypes["vae"]) if configs.vae is not None else None
    return MetaComponents(adapter, build(configs.transformer), tes, vae, dtypes, configs, build)


def block_bytes(transformer: nn.Module) -> int:
    """Bytes of the largest FSDP unit (``flowrl.distributed.fsdp.block_modules``: what FSDP unshards at once)."""
    from ..distributed.fsdp import block_modules

    return max((module_bytes(b) for b in block_modules(transformer)), default=module_bytes(transformer))
