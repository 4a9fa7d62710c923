"""``flowrl export``: a training run's weights in the format diffusers loads.

LoRA runs (``train.lora_rank > 0``) become a diffusers LoRA file,
``OUT_DIR/pytorch_lora_weights.safetensors``, written by the pipeline's own
``save_lora_weights`` from peft's ``get_peft_model_state_dict``, with the adapter's ``LoraConfig``
(rank, alpha, target modules) as ``lora_adapter_metadata`` inside the file, so the scaling
``alpha / r`` survives the round trip (without metadata diffusers assumes ``alpha = r``)::

    pipe = StableDiffusion3Pipeline.from_pretrained(base)   # or FluxPipeline
    pipe.load_lora_weights(OUT_DIR)

Which classes write and load the file is declared by the model's adapter (``pipelines/base.py``:
``transformer_class``, ``lora_writer()``, ``lora_load_hint()``), found through
``flowrl.pipelines.policy_class``. A model with several trained transformers declares ``lora_parts``:
Wan2.2 T2V-A14B's two experts give ``pytorch_lora_weights.safetensors`` (``transformer``) and
``pytorch_lora_weights_transformer_2.safetensors`` (loaded with ``load_into_transformer_2=True``).
The ``digits`` model has no diffusers pipeline; its adapter is written in the same format (keys
``transformer.*``) and loads into the bare transformer::

    tr = SD3Transformer2DModel.from_pretrained(base, subfolder="transformer")
    tr.load_lora_adapter(OUT_DIR, weight_name="pytorch_lora_weights.safetensors")

(``load_lora_adapter`` looks for a pickled ``.bin`` unless told the safetensors name.)

Full fine-tunes (``train.lora_rank == 0``) have no adapter: the whole trained transformer is
written with ``save_pretrained`` to ``OUT_DIR/transformer`` (Wan2.2's second expert to
``OUT_DIR/transformer_2``; load it with
``<Transformer>.from_pretrained(OUT_DIR, subfolder="transformer")`` and pass it to the pipeline as
``transformer=``).

Nothing but the transformer's ``config.json`` is read from the base model for a LoRA export: the
adapter is laid out on an empty (meta-device) transformer, which also checks that the checkpoint
fits the architecture. ``OUT_DIR/flowrl_export.json`` records where the weights came from.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Union

import torch

from .checkpoints import checkpoint_tensors, format_of
from .checkpoints.common import CheckpointError, list_checkpoints
from .checkpoints.runs import base_model_path as runs_base_path, is_run_directory
from .trainers.config import Config, load_run_config
from .errors import ConfigError
from .utils.io import atomic_dir, write_json

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
EXPORT_JSON = "flowrl_export.json"

_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "variant")


class ExportError(ConfigError):
    """The run cannot be exported as asked; the message says why and what to do."""


# ---------------------------------------------------------------- locating things
def resolve_checkpoint(run_dir: Path, checkpoint: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The checkpoint directory to export: ``checkpoint`` (a path, or a name under
    ``RUN/checkpoints``) or the run's latest."""
    if checkpoint is not None:
        p = Path(checkpoint)
        if not p.is_dir() and (run_dir / "checkpoints" / str(checkpoint)).is_dir():
            p = run_dir / "checkpoints" / str(checkpoint)
        if p.is_file() and p.name.endswith(".safetensors"):
            p = p.parent
        if not format_of(p).is_one(p):
            have = ", ".join(c.name for c in list_checkpoints(run_dir / "checkpoints")) or "none"
            raise ExportError(f"--checkpoint {checkpoint}: not a checkpoint directory (no trainable.safetensors). "
                              f"Checkpoints of {run_dir}: {have}")
        return p
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise ExportError(f"run {run_dir} has no checkpoint yet (checkpoints/iter_NNNNNN is written every "
                          f"train.checkpoint_every iterations and at the end); train it first or wait for one")
    return ckpts[-1]


def read_run_weights(run_dir: Path, checkpoint: Optional[Union[str, os.PathLike]] = None,
                     group: str = "trainable") -> tuple[Path, Optional[dict[str, torch.Tensor]]]:
    """(the checkpoint ``--checkpoint`` names, default the run's newest, and its ``group`` tensors: None when
    it has no such group), for ``sample``, ``eval`` and ``export``. An unreadable newest checkpoint (a
    truncated file) falls back to the previous readable one, as ``train --resume`` does, with a notice on
    stderr naming both; a named checkpoint that is unreadable, or no readable one, is a
    :class:`CheckpointError` naming it."""
    newest = resolve_checkpoint(run_dir, checkpoint)
    candidates = [newest] if checkpoint is not None else list_checkpoints(run_dir / "checkpoints")[::-1]
    failed: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            tensors = checkpoint_tensors(path, group)
        except CheckpointError as e:
            cause = e.__cause__ or e
            failed.append((path, f"{type(cause).__name__}: {str(cause)[:200]}"))
            continue
        if failed:
            print(f"[flowrl] WARNING: the newest checkpoint {newest} is unreadable ({failed[0][1]}); using the "
                  f"previous readable one, {path.name}", file=sys.stderr, flush=True)
        return path, tensors
    if checkpoint is not None:
        have = ", ".join(c.name for c in list_checkpoints(run_dir / "checkpoints")) or "none"
        raise CheckpointError(f"--checkpoint {checkpoint}: {newest} is unreadable ({failed[0][1]}); pick another "
                              f"(checkpoints of {run_dir}: {have})")
    raise CheckpointError(f"no readable checkpoint in {run_dir / 'checkpoints'}: the newest, {newest.name}, is "
                          f"unreadable ({failed[0][1]}), and so is every older one; retrain, or restore the files")


def base_model_path(cfg: Config, model_path: Optional[str] = None) -> str:
    """Where the run's base model lives: ``model_path`` if given, else the config's ``model.path``
    (an embedded world, digits or shapes: its cached base when empty)."""
    if model_path:
        return str(model_path)
    path = runs_base_path(cfg.model.path)  # model.path a run directory: the base of its chain of runs
    from flowrl.pipelines import policy_class

    cached = getattr(policy_class(cfg.model.pipeline), "default_base_path", None)  # an embedded world's cached base
    if cached is not None and path in (None, "", cfg.model.pipeline):
        return str(cached())
    if not path:
        raise ExportError(f"the run's config has no model.path for pipeline {cfg.model.pipeline!r}; pass --model-path")
    return str(path)


def exportable_pipelines() -> list[str]:
    """Registered pipelines whose adapter declares what export needs (``transformer_class``, ``lora_writer``)."""
    from flowrl.pipelines import available, policy_class

    return [n for n in available() if _declares_export(policy_class(n))]


def _declares_export(cls) -> bool:
    return cls is not None and bool(getattr(cls, "transformer_class", "")) and hasattr(cls, "lora_writer")


def adapter_class(pipeline: str):
    """The adapter class of ``pipeline``, checked to declare the export writer."""
    from flowrl.pipelines import policy_class

    cls = policy_class(pipeline)
    if not _declares_export(cls):
        raise ExportError(f"export does not know pipeline {pipeline!r}: its adapter declares no transformer_class / "
                          f"lora_writer (pipelines/base.py). It writes diffusers LoRA files for "
                          f"{', '.join(exportable_pipelines())}. Its trained tensors are in the run's "
                          f"checkpoints/iter_*/trainable.safetensors (peft names) for a custom loader.")
    return cls


def _transformer_class(pipeline: str):
    from flowrl.pipelines.base import diffusers_attr

    return diffusers_attr(adapter_class(pipeline).transformer_class)


def _hub_kwargs(cfg: Config) -> dict:
    return {k: v for k, v in cfg.model.options.items() if k in _HUB_KWARGS}


def _empty_transformer(pipeline: str, base: str, hub_kwargs: dict, subfolder: str = "transformer") -> torch.nn.Module:
    from accelerate import init_empty_weights

    from .utils.hub import require_hub_model

    cls = _transformer_class(pipeline)
    require_hub_model(base, f"the {pipeline} base model", "the run's model.path, or --model-path",
                      hub_kwargs.get("cache_dir"))
    try:
        config = cls.load_config(base, subfolder=subfolder, **hub_kwargs)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read the {subfolder} config of the base model {base!r} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}). Export needs only "
                          f"{subfolder}/config.json: pass --model-path with a local copy of the base model, "
                          f"or set HF_HOME to the cache the run trained with") from None
    with init_empty_weights():
        return cls.from_config(config)


# ---------------------------------------------------------------- the two export kinds
def _lora_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    bad = [k for k in tensors if ".lora_A." not in k and ".lora_B." not in k]
    if bad:
        raise ExportError(f"the checkpoint holds non-LoRA tensors ({bad[:3]}) although the run trained a LoRA; "
                          f"was it written by another flowrl version?")
    return sorted({k.split(".lora_")[0] for k in tensors})


def export_lora(cfg: Config, tensors: dict[str, torch.Tensor], out_dir: Path, base: str) -> dict:
    """Write ``tensors`` (a LoRA checkpoint, peft names) as a diffusers LoRA file; returns a summary."""
    return write_lora(cfg.model.pipeline, tensors, out_dir, base, cfg.train.lora_rank, cfg.train.lora_alpha,
                      _hub_kwargs(cfg))


def lora_parts(pipeline: str, tensors: dict[str, torch.Tensor]) -> list[tuple[str, str, dict[str, torch.Tensor]]]:
    """``[(pipeline component, file name, tensors)]``: the adapter's ``lora_parts`` (Wan2.2: one per trained
    expert, ``transformer`` and ``transformer_2``), else the one transformer's."""
    adapter = adapter_class(pipeline)
    if hasattr(adapter, "lora_parts"):
        try:
            return adapter.lora_parts(tensors)
        except ValueError as e:
            raise ExportError(f"the checkpoint's tensors do not fit pipeline {pipeline!r}: {e}") from None
    return [("transformer", LORA_WEIGHT_NAME, tensors)]


def write_lora(pipeline: str, tensors: dict[str, torch.Tensor], out_dir: Path, base: str, r: int, alpha: float,
               hub_kwargs: Optional[dict] = None) -> dict:
    """``tensors`` (LoRA weights in peft names, rank ``r``, scaling ``alpha / r``) of a ``pipeline``
    transformer as ``out_dir/pytorch_lora_weights.safetensors``, written by the adapter's declared
    ``lora_writer().save_lora_weights`` with the ``LoraConfig`` as metadata; a pipeline with several
    trained transformers (Wan2.2's experts) gets one file per component (:func:`lora_parts`). Returns a summary."""
    adapter = adapter_class(pipeline)
    modules = _lora_modules(tensors)
    ranks = {int(v.shape[0]) for k, v in tensors.items() if ".lora_A." in k}
    if ranks != {r}:
        raise ExportError(f"the checkpoint's LoRA ranks {sorted(ranks)} differ from the run's train.lora_rank={r}")
    files = {}
    for component, weight_name, part in lora_parts(pipeline, tensors):
        _write_lora_part(adapter, pipeline, component, part, out_dir / weight_name, base, r, alpha, hub_kwargs or {})
        files[component] = weight_name
    hint = adapter.lora_load_hint() if list(files) == ["transformer"] else adapter.lora_load_hint(list(files))
    return {"kind": "lora", "file": next(iter(files.values())), "files": files, "rank": r, "alpha": alpha,
            "scaling": alpha / r, "modules": len(modules), "load": hint}


def _write_lora_part(adapter, pipeline: str, component: str, tensors: dict[str, torch.Tensor], out: Path, base: str,
                     r: int, alpha: float, hub_kwargs: dict) -> None:
    """One component's LoRA file ``out``, checked against that component's architecture in ``base``."""
    from peft.utils import get_peft_model_state_dict

    from .trainable import add_lora

    skeleton = _empty_transformer(pipeline, base, hub_kwargs, component)
    try:
        # the training code path, with the exact module names the checkpoint adapted
        add_lora(skeleton, r, alpha, _lora_modules(tensors))
    except ValueError as e:
        raise ExportError(f"the checkpoint does not fit the base model {base!r}: {e}") from None
    expected = {n: tuple(p.shape) for n, p in skeleton.named_parameters() if p.requires_grad}
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    if expected != got:
        diff = sorted(set(expected) ^ set(got)) or [n for n in got if expected[n] != got[n]]
        raise ExportError(f"the checkpoint does not fit the base model {base!r}: tensor names or shapes differ "
                          f"(e.g. {diff[:3]}); was the run trained on another model? Pass --model-path")
    layers = get_peft_model_state_dict(skeleton, state_dict=tensors)  # drops the adapter name ("default")
    metadata = skeleton.peft_config["default"].to_dict()  # r, lora_alpha, target_modules, ...
    metadata = json.loads(json.dumps(metadata, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    adapter.lora_writer().save_lora_weights(
        str(out.parent), transformer_lora_layers={k: v.contiguous() for k, v in layers.items()},
        transformer_lora_adapter_metadata=metadata, weight_name=out.name)


def export_full(cfg: Config, tensors: dict[str, torch.Tensor], out_dir: Path, base: str) -> dict:
    """Full fine-tune: the base transformer (each trained one: Wan2.2's experts) with every trained tensor
    replaced, ``save_pretrained`` to ``OUT/<component>``."""
    from .trainable import load_trainable_state

    cls = _transformer_class(cfg.model.pipeline)
    dtype = next(iter(tensors.values())).dtype
    dirs = []
    for component, _, part in lora_parts(cfg.model.pipeline, tensors):
        try:
            tr = cls.from_pretrained(base, subfolder=component, dtype=dtype, **_hub_kwargs(cfg))
        except (OSError, ValueError) as e:
            raise ExportError(f"cannot load the base {component} from {base!r} ({type(e).__name__}); a full "
                              f"fine-tune export needs the base weights: pass --model-path") from None
        tr.requires_grad_(True)  # every parameter was trained: load_trainable_state checks them all
        try:
            load_trainable_state(tr, part)
        except ValueError as e:
            raise ExportError(f"the checkpoint does not fit the base model {base!r}: {e}") from None
        tr.requires_grad_(False).save_pretrained(str(out_dir / component))
        dirs.append(component)
    name = adapter_class(cfg.model.pipeline).transformer_class
    load = " and ".join(f"{name}.from_pretrained(OUT, subfolder={c!r})" for c in dirs)
    return {"kind": "full", "dir": dirs[0], "dirs": dirs,
            "load": f"{load}, passed to the pipeline as {' / '.join(c + '=' for c in dirs)}"}


# ---------------------------------------------------------------- entry point
def export_run(run_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *, ema: bool = False,
               checkpoint: Optional[Union[str, os.PathLike]] = None, model_path: Optional[str] = None,
               overwrite: bool = False) -> dict:
    """Export a run's trained weights (see module doc); returns the summary also written to
    ``OUT_DIR/flowrl_export.json``.

    Args:
        run_dir: a ``flowrl train`` output directory.
        out_dir: where to write: absent or empty (or a previous export, with ``overwrite``).
        ema: export the EMA weights (``ema.safetensors``; the run needs ``train.ema: true``).
        checkpoint: a checkpoint directory (or its name, e.g. ``iter_000040``); default the latest.
        model_path: the base model (directory or hub id) if not the run's ``model.path``.
        overwrite: replace a previous export in ``out_dir`` (a directory holding ``flowrl_export.json``).
    """
    run, out = Path(run_dir), Path(out_dir)
    if not (run / "config.yaml").is_file():
        raise ExportError(f"{run} is not a flowrl run directory (no config.yaml)")
    cfg = load_run_config(run / "config.yaml")
    adapter_class(cfg.model.pipeline)  # raises the explanation when the adapter declares no export writer
    ck, tensors = read_run_weights(run, checkpoint, "ema" if ema else "trainable")
    fname = "ema.safetensors" if ema else "trainable.safetensors"
    if tensors is None:
        raise ExportError(f"{ck} has no {fname}: the run was trained without train.ema; export without --ema")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"output dir {out} exists and is not empty; choose another or pass --overwrite")
        if not (out / EXPORT_JSON).is_file():
            raise ExportError(f"--overwrite replaces only a previous export (a directory holding {EXPORT_JSON}); "
                              f"{out} is not one, so it is left alone: choose another output dir")
    if not tensors:
        raise ExportError(f"{ck / fname} holds no tensors")
    base = base_model_path(cfg, model_path)
    info: dict = {}

    def write(tmp: Path) -> None:  # a sibling temporary directory, renamed into place when complete
        tmp.mkdir(parents=True)
        done = export_lora(cfg, tensors, tmp, base) if cfg.train.lora_rank > 0 else export_full(cfg, tensors, tmp, base)
        try:
            state = json.loads((ck / "trainer_state.json").read_text())
        except (OSError, ValueError):  # absent or unreadable: the weights are what is exported
            state = {}
        info.update({**done, "pipeline": cfg.model.pipeline, "base_model": base, "run_dir": str(run.resolve()),
                     "checkpoint": ck.name, "iteration": state.get("iteration"), "weights": "ema" if ema else "trained",
                     "load": done["load"].replace("BASE", repr(base)).replace("OUT", repr(str(out)))})
        if cfg.train.lora_rank > 0 and is_run_directory(cfg.model.path):  # trained on a run
            info["note"] = (f"the LoRA applies to {base} with the run {cfg.model.path}'s trained weights fused in (its "
                            f"model.path); export that run and fuse it first, or load both in order")
        write_json(info, tmp / EXPORT_JSON)

    atomic_dir(out, write)
    return info
