"""Where a command will write, checked before it does any work: a directory option (``--out DIR``, made
when absent) or a file option (``--json FILE``).

Each check probes the place as the write will use it: it makes the missing directories and a hidden
file in the innermost one, then removes everything it made. So a file where a directory belongs, a
directory where a file belongs, a directory without write permission or a read-only file system fails
as one :class:`~flowrl.errors.ConfigError` naming the option, before hours of work whose result would
then be lost. (Permission bits alone would not do: root may create files anywhere ``os.access`` is
asked about, yet not on a read-only mount or under ``/sys``.)
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

from ..errors import ConfigError

PathLike = Union[str, os.PathLike]

__all__ = ["check_output_dir", "check_output_file"]


def check_output_dir(path: PathLike, flag: str) -> None:
    """``path`` (given as option ``flag``) can be a directory this process writes files in: an existing
    directory, or one it can make. A :class:`ConfigError` naming ``flag`` and the fix otherwise."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory; give a directory (made when absent), "
                          f"e.g. {flag} {p.with_suffix('')}_out")
    _probe(p, flag, path)


def check_output_file(path: PathLike, flag: str) -> None:
    """``path`` (given as option ``flag``) can be a file this process writes: not a directory, and its
    folder writable (made when absent). A :class:`ConfigError` naming ``flag`` and the fix otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory, not a file; give a file path, e.g. {flag} "
                          f"{p / ('result' + (p.suffix or '.json'))}")
    _probe(p.parent, flag, path)


def _probe(directory: Path, flag: str, given: PathLike) -> None:
    """Make ``directory`` (and its missing parents) and a hidden file in it, then remove all of it."""
    missing, d = [], directory
    while not d.exists() and not d.is_symlink():  # (a dangling link is no directory: mkdir fails below)
        missing.append(d)
        d = d.parent
    if not d.is_dir():
        raise ConfigError(f"{flag} {given}: {d} is not a directory (a file stands there); choose a path whose "
                          f"folders are directories")
    made: list[Path] = []
    into = directory  # the directory a failed step was writing in
    try:
        for m in reversed(missing):  # outermost first
            into = m.parent
            m.mkdir()
            made.append(m)
        into = directory
        fd, tmp = tempfile.mkstemp(prefix=".flowrl-write-check-", dir=directory)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        reason = (e.strerror or type(e).__name__).lower()
        raise ConfigError(f"{flag} {given}: cannot write in {into} ({reason}); choose a place this user can "
                          f"write to") from None
    finally:
        for m in reversed(made):  # innermost first: leave nothing behind
            try:
                m.rmdir()
            except OSError:
                pass
