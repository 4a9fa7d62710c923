"""Progress reports that suit where they go: a tqdm bar on a terminal, plain periodic lines in a log.

tqdm redraws its bar with carriage returns, so a redirected log of a 30-iteration run holds hundreds
of overwritten updates on one line. :func:`progress` returns a tqdm bar when stderr is a terminal
and otherwise a :class:`PlainProgress`, which writes one line every ``every_seconds`` and a last
one when it closes, e.g. ``flowrl train: 12/30 (40%), 25 s elapsed, reward=0.912``.
Both take the calls flowrl makes: iteration, ``update``, ``set_postfix``, ``close``.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, Optional, TextIO

PLAIN_EVERY_SECONDS = 30.0


class PlainProgress:
    """A tqdm stand-in for logs: one line per ``every_seconds`` of progress, and the final count."""

    def __init__(self, iterable: Optional[Iterable] = None, *, total: Optional[int] = None, initial: int = 0,
                 desc: str = "", unit: str = "it", every_seconds: float = PLAIN_EVERY_SECONDS,
                 stream: Optional[TextIO] = None):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = initial + len(iterable)  # tqdm's convention: ``initial`` items were done before
        self.iterable, self.total, self.n, self.desc, self.unit = iterable, total, initial, desc, unit
        self.every, self.stream = every_seconds, stream
        self.postfix: dict[str, Any] = {}
        self.start = self.last = time.monotonic()
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._write()

    def set_postfix(self, ordered_dict: Optional[dict] = None, refresh: bool = True, **kwargs: Any) -> None:
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._write()

    def line(self) -> str:
        """The progress as one line (what is written)."""
        count = f"{self.n}/{self.total}" if self.total else f"{self.n} {self.unit}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        post = "".join(f", {k}={v}" for k, v in self.postfix.items())
        return f"{self.desc + ': ' if self.desc else ''}{count}{pct}, {time.monotonic() - self.start:.0f} s elapsed{post}"

    def _write(self) -> None:
        stream = self.stream or sys.stderr
        print(self.line(), file=stream, flush=True)


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, initial: int = 0, desc: str = "",
             unit: str = "it", disable: bool = False, every_seconds: float = PLAIN_EVERY_SECONDS, **tqdm_kwargs: Any):
    """A progress report over ``iterable`` (or counted by ``update``): tqdm on a terminal (``tqdm_kwargs``
    passed on), :class:`PlainProgress` lines when stderr is redirected, nothing when ``disable``."""
    from tqdm.auto import tqdm

    if disable or getattr(sys.stderr, "isatty", lambda: False)():
        return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=disable, **tqdm_kwargs)
    return PlainProgress(iterable, total=total, initial=initial, desc=desc, unit=unit, every_seconds=every_seconds)
