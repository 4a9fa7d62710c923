"""A training run directory as a base model: ``model.path: RUN_DIR`` starts a run (RL after SFT, SFT after RL)
from another run's weights.

The run's own base (its ``config.yaml``'s ``model.path``, itself possibly a run directory) is loaded, then the
newest checkpoint's weights are applied: its EMA weights when it kept them (what the run evaluated), else its
trained ones; a LoRA run's adapter is merged into the base weights (``W + alpha / r * B A``) and removed, so the
new run's LoRA (or full fine-tune) starts from the merged model. ``flowrl export``'s LoRA folder is loaded by the
diffusers pipelines themselves; a digits run is loaded from its run directory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Union

import yaml

from ..trainable import load_trainable_state, set_up_trainable
from . import checkpoint_tensors
from .common import CheckpointError, list_checkpoints

__all__ = ["is_run_dir", "load_from_run"]


def is_run_dir(path) -> bool:
    """Whether ``path`` is a flowrl run directory with checkpoints (``config.yaml`` + ``checkpoints/``)."""
    if not path or not isinstance(path, (str, os.PathLike)):
        return False
    p = Path(path).expanduser()
    return (p / "config.yaml").is_file() and (p / "checkpoints").is_dir()


def load_from_run(run_dir: Union[str, os.PathLike], pipeline: str, build: Callable[[str], object]):
    """The policy ``build(base_path)`` makes of the run's base, with the run's newest weights applied (module doc).
    ``pipeline``: the caller's ``model.pipeline``, which must be the run's."""
    run = Path(run_dir).expanduser()
    saved = yaml.safe_load((run / "config.yaml").read_text()) or {}
    model, train = saved.get("model") or {}, saved.get("train") or {}
    if model.get("pipeline") != pipeline:
        raise CheckpointError(f"model.path {run} is a run of pipeline {model.get('pipeline')!r}, this recipe's is "
                              f"{pipeline!r}; set model.pipeline={model.get('pipeline')}")
    ckpts = list_checkpoints(run / "checkpoints")
    if not ckpts:
        raise CheckpointError(f"model.path {run} is a run directory without a checkpoint; train it first")
    tensors = checkpoint_tensors(ckpts[-1], "ema") or checkpoint_tensors(ckpts[-1], "trainable")
    policy = build(model.get("path"))  # the run's own base (a path, a hub id, or another run directory)
    tr = policy.transformer
    rank = int(train.get("lora_rank", 8))
    set_up_trainable(tr, rank, float(train.get("lora_alpha", 16.0)), train.get("lora_targets"),
                     getattr(policy, "lora_target_modules", None), seed=int(train.get("seed", 0)))
    load_trainable_state(tr, tensors)
    if rank > 0:  # merge the adapter into the weights, then drop it
        tr.fuse_lora(lora_scale=1.0)
        tr.unload_lora()
    tr.requires_grad_(False)
    return policy
