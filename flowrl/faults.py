"""Fault injection for crash tests: ``FLOWRL_FAULT=point:iteration`` kills the process with
SIGKILL when it reaches ``point`` at ``iteration`` (e.g. ``checkpoint_mid:2``,
``after_rollout:1``). Unset (the normal case), it does nothing."""
from __future__ import annotations

import os
import signal

POINTS = ("after_rollout", "after_update", "checkpoint_mid", "checkpoint_before_rename")


def maybe_fault(point: str, iteration: int) -> None:
    spec = os.environ.get("FLOWRL_FAULT")
    if not spec:
        return
    name, _, it = spec.partition(":")
    if name == point and (not it or int(it) == iteration):
        os.kill(os.getpid(), signal.SIGKILL)
