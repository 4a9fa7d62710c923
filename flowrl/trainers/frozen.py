"""Frozen models an update evaluates beside the trained one (``Needs.frozen_models``: on-policy distillation's
teachers), from a source string, loaded once by the trainer through ``UpdateContext.load_frozen``.

A source is one of (checked in this order):

* ``""``: the run's own base model (``model.pipeline`` / ``model.path`` / ``model.options``), a second copy of it;
* a run directory (it holds ``config.yaml``): its saved model section with the trained weights of its newest
  readable checkpoint applied (LoRA or a full fine-tune, as it trained);
* a recipe (a ``.yaml`` file, or the name of a shipped recipe such as ``digits``): its ``model`` section;
* anything else: a model path or hub id of the run's ``model.pipeline`` (with the run's ``model.options``).

Every frozen model is built with its own guidance scale (``None``: the source's own ``model.guidance_scale``), its
parameters frozen, in eval mode, on the training device, or in host memory moved in for each forward when
``offload`` (:func:`flowrl.distributed.offload.keep_on_host`); ``train.offload.text_encoders`` / ``vae`` apply to it
as to the trained model. ``flowrl plan`` sizes it from :func:`frozen_model_config` (docs/memory.md).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

from ..builders import build_policy_from_config
from ..checkpoints import checkpoint_tensors
from ..checkpoints.common import CheckpointError, list_checkpoints
from ..distributed.offload import Offload, keep_on_host, offload_idle
from ..errors import ConfigError
from ..trainable import load_trainable_state, set_up_trainable
from .config_text import recipes_dir


@dataclasses.dataclass(frozen=True)
class FrozenSource:
    """What a source string resolves to: the model section to build and, for a run directory, its config and the
    checkpoint whose trained weights go on top."""

    kind: str  # base | run | recipe | path
    model: object  # a ModelConfig
    run_config: Optional[object] = None  # a run's Config (its train section sets up LoRA), for kind "run"
    checkpoint: Optional[Path] = None


def _is_recipe(source: str) -> bool:
    p = Path(source)
    if p.suffix in (".yaml", ".yml"):
        return True
    return len(p.parts) == 1 and (recipes_dir() / f"{p.name}.yaml").is_file()


def frozen_model_config(cfg, source: str, guidance: Optional[float] = None) -> FrozenSource:
    """The model section (and, for a run directory, the checkpoint) of frozen-model ``source`` for the run ``cfg``
    (module doc), at ``guidance`` (None: the source's own). A run directory without a checkpoint is a
    :class:`ConfigError`."""
    from .config import load_config, load_run_config

    src = str(source or "")
    run_cfg, ck = None, None
    if not src:
        kind, model = "base", cfg.model
    elif (Path(src) / "config.yaml").is_file():
        kind, run_cfg = "run", load_run_config(Path(src) / "config.yaml")
        model = run_cfg.model
        cks = list_checkpoints(Path(src) / "checkpoints")
        if not cks:
            raise ConfigError(f"frozen model {src}: the run has no checkpoint yet (checkpoints/iter_NNNNNN); train it "
                              f"first, or give its base recipe or model path")
        ck = cks[-1]
    elif _is_recipe(src):
        kind, model = "recipe", load_config(src).model
    else:
        kind, model = "path", dataclasses.replace(cfg.model, path=src)
    changes = {"device": cfg.model.device, "text_embedding_cache": None, "drop_text_encoders": False}
    if guidance is not None:
        changes["guidance_scale"] = float(guidance)
    if model.pipeline != cfg.model.pipeline:
        raise ConfigError(f"frozen model {src!r} is a {model.pipeline} model and the run trains a {cfg.model.pipeline} "
                          f"one: its steps must be on the student's latents; give a {cfg.model.pipeline} source")
    return FrozenSource(kind, dataclasses.replace(model, **changes), run_cfg, ck)


def frozen_loader(cfg, device: torch.device):
    """``(source, guidance, offload) -> policy``: :func:`load_frozen_model` for the run ``cfg`` on ``device``
    (``UpdateContext.load_frozen``)."""
    return lambda source, guidance, offload: load_frozen_model(cfg, source, guidance, offload, device)


def load_frozen_model(cfg, source: str, guidance: Optional[float], offload: bool, device: torch.device):
    """The frozen policy of ``source`` (module doc) for the run ``cfg``, on ``device`` (host memory when ``offload``)."""
    src = frozen_model_config(cfg, source, guidance)
    policy = build_policy_from_config(SimpleNamespace(model=src.model), device)  # reads the model section only
    if src.kind == "run":
        t = src.run_config.train
        try:
            tensors = checkpoint_tensors(src.checkpoint, "trainable")
        except CheckpointError as e:
            raise ConfigError(f"frozen model {source}: {e}") from None
        set_up_trainable(policy.transformer, t.lora_rank, t.lora_alpha, t.lora_targets,
                         getattr(policy, "lora_target_modules", None), seed=t.seed)
        load_trainable_state(policy.transformer, tensors)
        print(f"[flowrl] frozen model {source}: checkpoint {src.checkpoint}, trained weights", file=sys.stderr,
              flush=True)
    policy.transformer.requires_grad_(False)
    policy.transformer.eval()
    policy.cfg_uncond_grad = False
    offload_idle(policy, Offload(**{k: bool(cfg.train.offload.get(k)) for k in ("text_encoders", "vae")}), device)
    if offload:
        keep_on_host(policy.transformer, device)
    return policy
