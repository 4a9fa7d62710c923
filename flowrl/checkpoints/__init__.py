"""Checkpoint formats, one class each: :class:`~flowrl.checkpoints.unsharded.UnshardedCheckpoint`
(``train.sharding=none``: whole tensors, written by the main process) and
:class:`~flowrl.checkpoints.sharded.ShardedCheckpoint` (``train.sharding=fsdp``: every process writes its
shards through ``torch.distributed.checkpoint``). Both share the directory layout ``iter_NNNNNN``, the
atomic rename and listing (:mod:`flowrl.checkpoints.common`).

Readers that do not know how a run was trained (``flowrl export``, ``flowrl sample``) use
:func:`load_checkpoint` / :func:`checkpoint_tensors`, which find the format from the directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from .common import unreadable
from .sharded import ShardedCheckpoint
from .unsharded import UnshardedCheckpoint


def format_of(path: Path) -> Union[type[UnshardedCheckpoint], type[ShardedCheckpoint]]:
    """The format class of the checkpoint directory ``path`` (unsharded unless it holds DCP shards)."""
    return ShardedCheckpoint if ShardedCheckpoint.is_one(path) else UnshardedCheckpoint


def load_checkpoint(path: Path) -> dict:
    """A checkpoint directory of either format as whole tensors on this process ->
    dict(state, trainable, ema, extra, optimizer, scheduler, torch_rng); a sharded checkpoint's
    ``optimizer`` is None."""
    return format_of(Path(path)).load(Path(path))


def checkpoint_tensors(path: Path, group: str) -> Optional[dict[str, torch.Tensor]]:
    """The whole ``trainable``, ``ema`` or ``extra_<name>`` tensors of a checkpoint of either format, or None;
    a file that cannot be read (truncated, not safetensors) is a :class:`CheckpointError`."""
    try:
        return format_of(Path(path)).tensors(Path(path), group)
    except Exception as e:  # noqa: BLE001 - SafetensorError, a DCP read error, ...: the checkpoint is unusable
        raise unreadable(Path(path), e) from e
