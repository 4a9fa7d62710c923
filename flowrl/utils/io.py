"""Atomic file writes: a temporary file in the same directory, fsynced, renamed into place, and
the directory fsynced, so a reader sees the old file or the new one, never a partial one, even
after a crash or power loss.

The temporary name is ``.<name>.tmp-<pid>`` (hidden, per process); a crash leaves at most such a
file behind, which callers that resume may delete (``<dir>.glob(".*.tmp-*")``).

What is published gets the permissions the umask allows (:func:`share_permissions`), as a plain
``open()`` would give: some writers create private 0600 files (safetensors 0.8's ``save_file``),
which teammates on a shared filesystem could not read.

:func:`exclusive` is the lock for work two processes must not do at once (pretraining the cached
digits base).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Union

PathLike = Union[str, os.PathLike]


def temp_path(path: PathLike) -> Path:
    """The temporary sibling ``.<name>.tmp-<pid>`` that :func:`atomic_write` writes first."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_dir(path: PathLike) -> None:
    """fsync a directory, so renames and new entries in it survive a power loss."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    """fsync a file's contents to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def share_permissions(path: PathLike) -> None:
    """Add to ``path`` (a file, or every file under a directory) the read/write bits the process's
    umask allows (``0o666 & ~umask``: 0644 under the usual 022), never removing any."""
    mask = os.umask(0)
    os.umask(mask)
    allowed = 0o666 & ~mask
    p = Path(path)
    for f in [p] if p.is_file() else (f for f in p.rglob("*") if f.is_file()):
        mode = f.stat().st_mode & 0o777
        if mode | allowed != mode:
            os.chmod(f, mode | allowed)


def atomic_write(path: PathLike, write: Callable[[Path], None]) -> Path:
    """Create or replace the file ``path`` atomically and durably.

    ``write(tmp)`` writes the whole content to the temporary sibling ``tmp``; then it is fsynced,
    renamed over ``path`` and the directory fsynced. If anything fails the temporary file is
    removed and the error propagates (``path`` keeps its old content). Creates missing parent
    directories. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        share_permissions(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_dir(out_dir: PathLike, write: Callable[[Path], None]) -> Path:
    """Create or replace the directory ``out_dir`` as a whole: ``write(tmp)`` fills the temporary
    sibling ``.<name>.tmp-<pid>``, which is then renamed into place (an existing ``out_dir`` is
    removed just before), so a crash during ``write`` leaves the old directory or none, never a
    half-written one. On an error the temporary directory is removed. Returns ``out_dir``."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        share_permissions(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)
    return out


def write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(obj: Any, path: PathLike, **dumps_kwargs: Any) -> Path:
    """Write ``obj`` as JSON (``indent=2`` unless given) to ``path`` atomically."""
    dumps_kwargs.setdefault("indent", 2)
    return write_text(path, json.dumps(obj, **dumps_kwargs))


def save_png(array, path: PathLike) -> Path:
    """Write a ``[H, W, 3]`` (or ``[H, W]``) uint8 array as a PNG atomically."""
    from PIL import Image

    return atomic_write(path, lambda tmp: Image.fromarray(array).save(tmp, format="PNG"))


def save_figure(fig, path: PathLike, dpi: int = 110) -> Path:
    """Lay out a matplotlib figure, write it as PNG atomically, close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)


@contextlib.contextmanager
def exclusive(path: PathLike, what: str) -> Iterator[None]:
    """Hold the lock file ``path`` (created with its directory; ``filelock``) for the block, so two
    processes never do ``what`` at once; one that has to wait says so on stderr, once, then waits.
    Release is automatic, also when the holder dies (the OS drops its lock)."""
    from filelock import FileLock, Timeout

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[flowrl] another process is {what}: waiting for it to finish (lock {path})", file=sys.stderr,
              flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
