"""Atomic checkpoints: written under a temporary name, fsynced, then renamed into place.

A directory named ``iter_NNNNNN`` is therefore always complete; a crash mid-write leaves only a
``.tmp-*`` directory, which loading ignores and the next save removes. Everything is read back
with safetensors or ``torch.load(weights_only=True)`` (no pickled code).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from ..faults import maybe_fault
from ..utils.io import fsync_dir, fsync_file, share_permissions

__all__ = ["CheckpointError", "save_checkpoint", "list_checkpoints", "load_checkpoint", "fsync_dir", "PATTERN",
           "STATE_FILE"]  # fsync_dir lives in flowrl.utils.io (re-exported here)

PATTERN = re.compile(r"^iter_(\d{6,})$")
STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says how to recover."""


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            fsync_file(f)
    fsync_dir(path)


def save_checkpoint(root: Path, iteration: int, *, trainable: dict[str, torch.Tensor],
                    optimizer: dict, scheduler: dict, state: dict,
                    ema: Optional[dict[str, torch.Tensor]] = None, keep: int = 2,
                    extra: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> Path:
    """Write ``root/iter_{iteration:06d}`` atomically and prune to the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp-iter_{iteration:06d}-{os.getpid()}"
    tmp.mkdir()
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        maybe_fault("checkpoint_mid", iteration)
        if ema is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in ema.items()}, str(tmp / "ema.safetensors"))
        for name, tensors in (extra or {}).items():  # further named tensor sets (e.g. NFT's old policy)
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / f"extra_{name}.safetensors"))
        torch.save(optimizer, tmp / "optimizer.pt")
        torch.save({"scheduler": scheduler, "torch_rng": torch.get_rng_state()}, tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=2))
        share_permissions(tmp)  # safetensors writes 0600 files: readable by the team like the others
        _fsync_tree(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # e.g. disk full: leave nothing that could be mistaken for a checkpoint
        if isinstance(e, OSError):
            raise CheckpointError(f"writing checkpoint {final.name} failed ({e}); the previous checkpoints are "
                                  f"intact. Free disk space (or fix permissions) and resume with --resume.") from e
        raise
    publish(tmp, final, iteration, keep)
    return final


def publish(tmp: Path, final: Path, iteration: int, keep: int) -> None:
    """Rename a complete, fsynced temporary checkpoint ``tmp`` to ``final`` (atomic), fsync the parent,
    and prune the parent to the newest ``keep`` checkpoints."""
    maybe_fault("checkpoint_before_rename", iteration)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for old in list_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint directory -> dict(trainable, ema, optimizer, scheduler, torch_rng, state). A sharded
    checkpoint (``train.sharding=fsdp``) comes back with whole tensors and ``optimizer`` None
    (``checkpoint_sharded.load_full_checkpoint``)."""
    from .checkpoint_sharded import is_sharded_checkpoint, load_full_checkpoint

    try:
        if is_sharded_checkpoint(path):
            return load_full_checkpoint(path)
        state = json.loads((path / STATE_FILE).read_text())
        out = {"state": state, "trainable": load_file(str(path / "trainable.safetensors"))}
        out["ema"] = load_file(str(path / "ema.safetensors")) if (path / "ema.safetensors").exists() else None
        out["extra"] = {f.stem[len("extra_"):]: load_file(str(f)) for f in path.glob("extra_*.safetensors")}
        out["optimizer"] = torch.load(path / "optimizer.pt", weights_only=True)
        sch = torch.load(path / "scheduler.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable part means the checkpoint is unusable
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}). Delete it to resume "
                              f"from the previous one, or start a new run in another --output-dir.") from e
    out["scheduler"], out["torch_rng"] = sch["scheduler"], sch["torch_rng"]
    return out
