"""A flowrl run directory as a model: ``model.path`` (or a teacher's source) may name a finished run, whose base
model plus the trained weights of its newest checkpoint become the model a later run starts from.

:func:`run_model` reads what that needs from the run's saved ``config.yaml`` (its ``model.pipeline`` and
``model.path``: the base, itself possibly a run directory; its ``train.lora_*`` and ``train.seed``: how its
trained tensors sit on the transformer) and picks its newest checkpoint; :func:`apply_run_weights` puts those
tensors on a freshly loaded base transformer and, for a LoRA run, fuses the adapter into the base weights and
removes it, so the later run adds its own LoRA (and keeps its reference, the adapter-disabled model) on top of
the earlier run's result. :func:`base_model_path` follows a chain of runs down to the model directory or hub id
(what ``flowrl plan`` reads configs from and ``flowrl export`` lays a LoRA out on).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml
from torch import nn

from ..errors import ConfigError
from .common import list_checkpoints


@dataclass(frozen=True)
class RunModel:
    """What a run directory contributes to a model (module doc)."""

    run: Path
    pipeline: str
    base: Optional[str]  # the run's model.path (None / "": the pipeline's default, e.g. the cached digits base)
    lora_rank: int
    lora_alpha: float
    lora_targets: Optional[list]
    seed: int
    checkpoint: Path


def is_run_directory(path) -> bool:
    """Whether ``path`` is a flowrl run directory (it holds ``config.yaml`` and ``checkpoints/``)."""
    return bool(path) and (Path(str(path)) / "config.yaml").is_file() and (Path(str(path)) / "checkpoints").is_dir()


def run_model(path) -> RunModel:
    """The run directory ``path`` as a model (module doc); no checkpoint yet, or an unreadable config, is a
    :class:`ConfigError` naming the run."""
    run = Path(str(path))
    try:
        d = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"model {run}: its config.yaml is not valid YAML ({e})") from None
    model, train = d.get("model") or {}, d.get("train") or {}
    cks = list_checkpoints(run / "checkpoints")
    if not cks:
        raise ConfigError(f"model {run} is a run directory without a checkpoint yet (checkpoints/iter_NNNNNN); train "
                          f"it first, or give its base model")
    return RunModel(run, str(model.get("pipeline", "digits")), model.get("path"), int(train.get("lora_rank", 0)),
                    float(train.get("lora_alpha", 16.0)), train.get("lora_targets"), int(train.get("seed", 0)),
                    cks[-1])


def run_chain(path) -> tuple[Optional[str], list[RunModel]]:
    """``(base, runs)``: the run directories ``path`` leads through (``path``'s own first, each the next one's
    ``model.path``) and the model directory, hub id or None they end at; a loop of runs is a :class:`ConfigError`."""
    runs: list[RunModel] = []
    while is_run_directory(path):
        if any(str(path) == str(rm.run) for rm in runs):
            raise ConfigError(f"model {path}: its runs' model.path form a loop")
        runs.append(run_model(path))
        path = runs[-1].base
    return path, runs


def base_model_path(path) -> Optional[str]:
    """``path`` with every run directory in the chain replaced by its base (a model directory, hub id or None)."""
    return run_chain(path)[0]


def apply_run_weights(transformer: nn.Module, rm: RunModel, default_targets=None) -> nn.Module:
    """``transformer`` (the base, freshly loaded) with run ``rm``'s newest trained weights: a full fine-tune's
    replace the weights; a LoRA is added, loaded, fused into the base weights and removed. Frozen on return."""
    from ..trainable import load_trainable_state, set_up_trainable
    from . import checkpoint_tensors

    tensors = checkpoint_tensors(rm.checkpoint, "trainable")
    set_up_trainable(transformer, rm.lora_rank, rm.lora_alpha, rm.lora_targets, default_targets, seed=rm.seed)
    try:
        load_trainable_state(transformer, tensors)
    except ValueError as e:
        raise ConfigError(f"model {rm.run}: {e}") from None
    if rm.lora_rank > 0:
        if not hasattr(transformer, "fuse_lora"):
            raise ConfigError(f"model {rm.run}: its LoRA cannot be fused into a {type(transformer).__name__} (no "
                              f"fuse_lora); export the run (flowrl export) and load the merged model instead")
        transformer.fuse_lora(lora_scale=1.0)  # W + (alpha / r) B A, then the adapter layers removed
        transformer.unload_lora()
    return transformer.requires_grad_(False)
