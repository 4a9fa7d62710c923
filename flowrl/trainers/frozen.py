"""Frozen models an update evaluates beside the trained one (``Needs.frozen_models``: on-policy distillation's
teachers), from a source string, loaded once by the trainer through ``UpdateContext.load_frozen``.

A source is one of (checked in this order):

* ``""``: the run's own base model (``model.pipeline`` / ``model.path`` / ``model.options``), a second copy of it;
* a run directory (``config.yaml`` and ``checkpoints/``): its saved model section, with the trained weights of its
  newest checkpoint fused into its base (LoRA or a full fine-tune, as it trained; :mod:`flowrl.checkpoints.runs`);
* a recipe (a ``.yaml`` file, or the name of a shipped recipe such as ``digits``): its ``model`` section;
* anything else: a model path or hub id of the run's ``model.pipeline`` (with the run's ``model.options``).

Every frozen model is built with its own guidance scale (``None``: the source's own ``model.guidance_scale``), its
parameters frozen, in eval mode, on the training device, or in host memory moved in for each forward when
``offload`` (:func:`flowrl.distributed.offload.keep_on_host`); ``train.offload.text_encoders`` / ``vae`` apply to it
as to the trained model. ``flowrl plan`` sizes it from :func:`frozen_model_config` (docs/memory.md).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

from ..builders import build_policy_from_config
from ..checkpoints.runs import is_run_directory, run_model
from ..distributed.offload import Offload, keep_on_host, offload_idle
from ..errors import ConfigError
from .config_text import recipes_dir


@dataclasses.dataclass(frozen=True)
class FrozenSource:
    """What a source string resolves to: its kind and the model section to build (a run directory's has the run as
    its ``path``: :func:`flowrl.builders.build_policy_from_config` fuses the run's weights into its base)."""

    kind: str  # base | run | recipe | path
    model: object  # a ModelConfig


def _is_recipe(source: str) -> bool:
    p = Path(source)
    if p.suffix in (".yaml", ".yml"):
        return True
    return len(p.parts) == 1 and (recipes_dir() / f"{p.name}.yaml").is_file()


def frozen_model_config(cfg, source: str, guidance: Optional[float] = None) -> FrozenSource:
    """The model section of frozen-model ``source`` for the run ``cfg`` (module doc), at ``guidance`` (None: the
    source's own). A run directory without a checkpoint, or a source of another pipeline, is a :class:`ConfigError`."""
    from .config import load_config, load_run_config

    src = str(source or "")
    if not src:
        kind, model = "base", cfg.model
    elif is_run_directory(src):
        kind = "run"
        model = dataclasses.replace(load_run_config(Path(src) / "config.yaml").model, path=src)
        run_model(src)  # a run without a checkpoint: one line now, not at the first update
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
    return FrozenSource(kind, dataclasses.replace(model, **changes))


def frozen_loader(cfg, device: torch.device):
    """``(source, guidance, offload) -> policy``: :func:`load_frozen_model` for the run ``cfg`` on ``device``
    (``UpdateContext.load_frozen``)."""
    return lambda source, guidance, offload: load_frozen_model(cfg, source, guidance, offload, device)


def load_frozen_model(cfg, source: str, guidance: Optional[float], offload: bool, device: torch.device):
    """The frozen policy of ``source`` (module doc) for the run ``cfg``, on ``device`` (host memory when ``offload``)."""
    src = frozen_model_config(cfg, source, guidance)
    policy = build_policy_from_config(SimpleNamespace(model=src.model), device)  # reads the model section only
    policy.transformer.requires_grad_(False)
    policy.transformer.eval()
    policy.cfg_uncond_grad = False
    offload_idle(policy, Offload(**{k: bool(cfg.train.offload.get(k)) for k in ("text_encoders", "vae")}), device)
    if offload:
        keep_on_host(policy.transformer, device)
    return policy
