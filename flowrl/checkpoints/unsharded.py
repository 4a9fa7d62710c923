"""The unsharded checkpoint format (``train.sharding=none``): the main process writes whole tensors.

Layout of ``iter_NNNNNN``::

    trainable.safetensors      the trained tensors by parameter name (LoRA weights, or every weight)
    ema.safetensors            their EMA (with train.ema)
    extra_<name>.safetensors   further named tensor sets (e.g. DiffusionNFT's old policy)
    optimizer.pt               the optimizer's state_dict
    scheduler.pt               LR scheduler + the torch RNG state
    trainer_state.json         counters, "iteration"

Written atomically (``common.publish``); read back with safetensors or ``torch.load(weights_only=True)``
(no pickled code).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..faults import maybe_fault
from .common import STATE_FILE, CheckpointError, fsync_tree, publish, unreadable

TRAINABLE = "trainable.safetensors"


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path))


class UnshardedCheckpoint:
    """``save`` on the main process (whole tensors), ``load`` anywhere."""

    @staticmethod
    def is_one(path: Path) -> bool:
        return (Path(path) / TRAINABLE).is_file()

    @staticmethod
    def save(root: Path, iteration: int, *, trainable: dict[str, torch.Tensor], optimizer: dict, scheduler: dict,
             state: dict, ema: Optional[dict[str, torch.Tensor]] = None, keep: int = 2,
             extra: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> Path:
        """Write ``root/iter_{iteration:06d}`` atomically and prune to the newest ``keep``."""
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        final = root / f"iter_{iteration:06d}"
        tmp = root / f".tmp-iter_{iteration:06d}-{os.getpid()}"
        tmp.mkdir()
        try:
            _save_tensors(trainable, tmp / TRAINABLE)
            maybe_fault("checkpoint_mid", iteration)
            if ema is not None:
                _save_tensors(ema, tmp / "ema.safetensors")
            for name, tensors in (extra or {}).items():
                _save_tensors(tensors, tmp / f"extra_{name}.safetensors")
            torch.save(optimizer, tmp / "optimizer.pt")
            torch.save({"scheduler": scheduler, "torch_rng": torch.get_rng_state()}, tmp / "scheduler.pt")
            (tmp / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=2))
            fsync_tree(tmp)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # e.g. disk full: leave nothing that could pass for a checkpoint
            if isinstance(e, OSError):
                raise CheckpointError(f"writing checkpoint {final.name} failed ({e}); the previous checkpoints are "
                                      f"intact. Free disk space (or fix permissions) and resume with --resume.") from e
            raise
        publish(tmp, final, iteration, keep)
        return final

    @staticmethod
    def load(path: Path) -> dict:
        """Read a checkpoint directory -> dict(state, trainable, ema, extra, optimizer, scheduler, torch_rng)."""
        try:
            state = json.loads((path / STATE_FILE).read_text())
            out = {"state": state, "trainable": load_file(str(path / TRAINABLE))}
            out["ema"] = load_file(str(path / "ema.safetensors")) if (path / "ema.safetensors").exists() else None
            out["extra"] = {f.stem[len("extra_"):]: load_file(str(f)) for f in path.glob("extra_*.safetensors")}
            out["optimizer"] = torch.load(path / "optimizer.pt", weights_only=True)
            sch = torch.load(path / "scheduler.pt", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable part means the checkpoint is unusable
            raise unreadable(path, e) from e
        out["scheduler"], out["torch_rng"] = sch["scheduler"], sch["torch_rng"]
        return out

    @staticmethod
    def tensors(path: Path, group: str) -> Optional[dict[str, torch.Tensor]]:
        """The whole tensors of ``group`` (``trainable``, ``ema``, ``extra_<name>``), or None when absent."""
        f = Path(path) / f"{group}.safetensors"
        return load_file(str(f)) if f.is_file() else None
