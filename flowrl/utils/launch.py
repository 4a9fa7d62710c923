"""Ending a process that a distributed launcher (torchrun, ``accelerate launch``) started.

Once a multi-process run has written everything and destroyed its process group, Python's own
interpreter finalization is the one step left that can still fail: torch's gloo backend keeps C++
threads which may release tensors (and so take the GIL) while the interpreter is being torn down. On
Python <= 3.13 such a thread is then unwound by ``pthread_exit`` inside a ``noexcept`` frame, and the
process dies with SIGABRT ("terminate called without an active exception") after a run that
succeeded; the launcher then reports a failed job (and kills the other ranks). Rare (twice in this
project's test runs of two CPU processes, both after the run had written everything), but then a
finished job reads as failed.

:func:`finish` skips finalization under a launcher: it flushes what Python would flush (standard
streams, logging handlers) and leaves with ``os._exit``. Everything a run keeps (checkpoints,
metrics, summary, samples) is written and closed before the trainer's shutdown returns, so nothing is
lost. A process started without a launcher exits the ordinary way.
"""
from __future__ import annotations

import logging
import os
import sys


def under_launcher() -> bool:
    """Whether a distributed launcher started this process (it sets ``WORLD_SIZE`` for every rank)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def finish(code: int | None) -> None:
    """Exit with ``code`` (None means 0): under a launcher through ``os._exit`` once the standard
    streams and logging handlers are flushed (no interpreter finalization, see the module docstring);
    otherwise through ``sys.exit``."""
    code = 0 if code is None else int(code)
    if not under_launcher():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to flush into
            pass
    os._exit(code)
