"""What both checkpoint formats share: the directory names, the error, listing, and the atomic publish.

A checkpoint is a directory ``iter_NNNNNN`` under a run's ``checkpoints/``. Either format writes it
under a temporary name, fsyncs it, then renames it into place (:func:`publish`), so a directory
named ``iter_NNNNNN`` is always complete; a crash mid-write leaves only a ``.tmp-*`` directory, which
loading ignores and the next save removes.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..faults import maybe_fault
from ..utils.io import fsync_dir, fsync_file, share_permissions

PATTERN = re.compile(r"^iter_(\d{6,})$")
STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says how to recover."""


def fsync_tree(path: Path) -> None:
    """Give every file under ``path`` the read bits the umask allows (safetensors writes 0600 files:
    teammates on a shared filesystem could not read the weights), fsync every file directly in
    ``path``, then the directory itself."""
    share_permissions(path)
    for f in path.iterdir():
        if f.is_file():
            fsync_file(f)
    fsync_dir(path)


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


def unreadable(path: Path, e: BaseException, kind: str = "checkpoint") -> CheckpointError:
    """The error for a ``kind`` checkpoint that cannot be read, with the way to recover."""
    return CheckpointError(f"{kind} {path} is unreadable ({type(e).__name__}: {str(e)[:300]}). Delete it to "
                           f"resume from the previous one, or start a new run in another --output-dir.")
