"""Sharded checkpoints (``train.sharding=fsdp``) through ``torch.distributed.checkpoint`` (DCP).

Layout of ``iter_NNNNNN`` (the same directory name and atomic rename as ``unsharded.py``)::

    dcp/                  every process writes its shards (``__R_0.distcp``), the main one ``.metadata``
                          groups: trainable (model state, frozen weights left out), optimizer (AdamW,
                          by parameter name), ema, extra_<name> (e.g. DiffusionNFT's old policy)
    scheduler.pt          LR scheduler + the main process's torch RNG state
    trainer_state.json    counters, plus {"format": "dcp", "num_processes": N, "ema": bool, "extra": [...]}

Atomic: every process writes into ``.tmp-iter_NNNNNN`` (one name all processes agree on); when all have
finished (DCP's save ends with a collective) the main process renames it into place, so a kill at any
moment leaves the previous checkpoint usable. DCP reshards on load, so a run resumes on any number of
processes; :meth:`ShardedCheckpoint.tensors` reads whole tensors on one process without a process group
(``flowrl export``, ``flowrl sample``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..faults import maybe_fault
from ..utils.io import fsync_dir
from .common import STATE_FILE, CheckpointError, fsync_tree, publish, unreadable

DCP_DIR = "dcp"
FORMAT = "dcp"
GROUPS = ("trainable", "ema")  # tensor groups keyed by trained-parameter name (plus extra_<name>)


def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)  # LoRA: the adapter only


def _trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(trained parameters by name, optimizer state by parameter name): what a checkpoint holds. The model's
    buffers are left out (they are not trained), as in the unsharded format."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_options())
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in msd.items() if k in trained}, osd


def _saved_names(path: Path, group: str) -> dict[str, "object"]:
    """``name -> TensorStorageMetadata`` of the tensors saved under ``group``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path / DCP_DIR)).read_metadata()
    pre = group + "."
    return {k[len(pre):]: m for k, m in md.state_dict_metadata.items()
            if k.startswith(pre) and isinstance(m, TensorStorageMetadata)}


class ShardedCheckpoint:
    """``save`` and ``restore`` are collective (every process calls them, each with its shards);
    ``load`` / ``tensors`` read whole tensors on one process, without a process group."""

    @staticmethod
    def is_one(path: Path) -> bool:
        return (Path(path) / DCP_DIR / ".metadata").is_file()

    @staticmethod
    def save(root: Path, iteration: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: dict, state: dict, ema: Optional[dict], extra: dict, keep: int,
             is_main: bool, barrier: Callable[[], None]) -> Path:
        """Collective: every process calls it. Writes ``root/iter_{iteration:06d}`` atomically, prunes to ``keep``."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        final, tmp = root / f"iter_{iteration:06d}", root / f".tmp-iter_{iteration:06d}"
        if is_main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        msd, osd = _trained_state(model, optimizer)
        payload = {"trainable": msd, "optimizer": osd, **({"ema": ema} if ema else {}),
                   **{f"extra_{k}": v for k, v in extra.items()}}
        from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException; wraps e.g. disk full)

        try:
            dcp.save(payload, storage_writer=FileSystemWriter(str(tmp / DCP_DIR), sync_files=True))
        except (OSError, CheckpointException) as e:
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"writing sharded checkpoint {final.name} failed ({e}); the previous checkpoints are "
                                  f"intact. Free disk space (or fix permissions) and resume with --resume.") from e
        maybe_fault("checkpoint_mid", iteration)
        if is_main:
            torch.save({"scheduler": scheduler, "torch_rng": torch.get_rng_state()}, tmp / "scheduler.pt")
            info = {"format": FORMAT, "num_processes": dist.get_world_size(), "ema": bool(ema), "extra": sorted(extra)}
            (tmp / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration, "sharded": info}, indent=2))
            fsync_tree(tmp)
            fsync_dir(tmp / DCP_DIR)
            publish(tmp, final, iteration, keep)
        barrier()
        return final

    @staticmethod
    def restore(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, ema: Optional[dict]) -> dict:
        """Collective: restore the trained weights and optimizer of ``model`` (sharded or not, any number of
        processes) and ``ema`` (tensors loaded in place). Returns ``{state, scheduler, torch_rng, extra}``;
        ``extra`` tensor sets come back shaped and sharded like the trained parameters."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import set_state_dict

        try:
            state = json.loads((path / STATE_FILE).read_text())
            info = state["sharded"]
            sch = torch.load(path / "scheduler.pt", weights_only=True)
            saved = set(_saved_names(path, "trainable"))
        except Exception as e:  # noqa: BLE001 - any unreadable part means the checkpoint is unusable
            raise unreadable(path, e, "sharded checkpoint") from e
        msd, osd = _trained_state(model, optimizer)
        if saved != set(msd):
            raise CheckpointError(f"checkpoint {path} does not match this model/config: missing "
                                  f"{sorted(set(msd) - saved)[:3]}, unexpected {sorted(saved - set(msd))[:3]} (was it "
                                  f"written with another lora_rank or pipeline?)")
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        extra = {k: {n: torch.empty_like(p.detach()) for n, p in trained.items()} for k in info["extra"]}
        payload = {"trainable": msd, "optimizer": osd, **({"ema": ema} if ema is not None and info["ema"] else {}),
                   **{f"extra_{k}": v for k, v in extra.items()}}
        from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)

        try:  # a missing or corrupt shard fails on every process alike (DCP gathers the errors)
            dcp.load(payload, storage_reader=FileSystemReader(str(path / DCP_DIR)))
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            raise unreadable(path, e, "sharded checkpoint") from e
        set_state_dict(model, optimizer, model_state_dict=payload["trainable"], optim_state_dict=payload["optimizer"],
                       options=_options(strict=False))  # the trained parameters only (key sets checked above)
        return {"state": state, "scheduler": sch["scheduler"], "torch_rng": sch["torch_rng"], "extra": extra}

    @staticmethod
    def load(path: Path) -> dict:
        """The checkpoint as :meth:`UnshardedCheckpoint.load` returns one, on one process (whole tensors;
        ``optimizer`` None: it is sharded by parameter name)."""
        read = ShardedCheckpoint.tensors
        try:
            state = json.loads((path / STATE_FILE).read_text())
            sch = torch.load(path / "scheduler.pt", weights_only=True)
            return {"state": state, "trainable": read(path, "trainable"), "ema": read(path, "ema"),
                    "extra": {k: read(path, f"extra_{k}") for k in state["sharded"]["extra"]},
                    "optimizer": None, "scheduler": sch["scheduler"], "torch_rng": sch["torch_rng"]}
        except Exception as e:  # noqa: BLE001 - any unreadable part means the checkpoint is unusable
            raise unreadable(path, e, "sharded checkpoint") from e

    @staticmethod
    def tensors(path: Path, group: str) -> Optional[dict[str, torch.Tensor]]:
        """Whole tensors of ``group`` (``trainable``, ``ema``, ``extra_<name>``) read on this process alone
        (no process group, no model), or None when the checkpoint has no such group."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        names = _saved_names(path, group)
        if not names:
            return None
        out = {n: torch.empty(tuple(m.size), dtype=m.properties.dtype) for n, m in names.items()}
        dcp.load({group: out}, storage_reader=FileSystemReader(str(path / DCP_DIR)), no_dist=True)
        return out
