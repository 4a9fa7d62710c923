"""How many threads torch uses for a command's CPU work, chosen once and said once.

torch's default (one thread per core) is right on an idle machine and a large model, and badly wrong
on a shared one: each thread spins at the end of every small matrix product waiting for the others,
and a core another process holds makes all of them wait. Measured on a 2-core machine shared with
other jobs (load average 8): pretraining the 0.58M-parameter digits base for 30 steps took 284 s with
torch's 2 threads and 47 s with one.

:func:`choose_threads` (pure): ``OMP_NUM_THREADS`` when set (torch already follows it); otherwise the
cores this process may use less the load other processes put on them (the 1-minute load average), at
least 1, and 1 for a model under :data:`SMALL_MODEL_PARAMS` parameters (its products are too small
to split). :func:`use_cpu_threads` applies it, once per command and only where the command line
asked for it (:func:`chosen_threads`: ``flowrl`` verbs that train or sample; library callers keep
their own setting), and prints one line on stderr.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

SMALL_MODEL_PARAMS = 2_000_000  # the digits base (0.58M) and the tiny smoke models are below
_state = {"enabled": False, "done": False}


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(cores: int, load: Optional[float], params: Optional[int], env: Optional[str],
                   procs: int = 1) -> tuple[int, str]:
    """(threads, why) for ``cores`` usable cores, the 1-minute ``load`` average (None: unknown), a model of
    ``params`` parameters (None: unknown), the ``OMP_NUM_THREADS`` value ``env`` (None: unset) and ``procs``
    processes of this run on the machine (a launcher's ``LOCAL_WORLD_SIZE``: they share the free cores)."""
    if env is not None and env.strip().isdigit() and int(env) > 0:
        return int(env), f"OMP_NUM_THREADS={env.strip()}"
    free = cores if load is None else max(1, min(cores, int(cores - load + 0.5)))
    free = max(1, free // max(1, procs))
    why = f"{cores} core(s)" + ("" if load is None else f", load average {load:.1f} from other processes") + \
        (f", {procs} processes of this run" if procs > 1 else "")
    if params is not None and params < SMALL_MODEL_PARAMS:
        return 1, f"{why}; a {params / 1e6:.2f}M-parameter model: more threads only add synchronisation"
    return free, why


@contextlib.contextmanager
def chosen_threads():
    """Within the block, :func:`use_cpu_threads` sets torch's threads (the ``flowrl`` command line's verbs
    that train or sample); afterwards torch's previous count is back (an in-process caller, e.g. a test,
    keeps its own)."""
    import torch

    before, saved = torch.get_num_threads(), dict(_state)
    _state.update(enabled=True, done=False)
    try:
        yield
    finally:
        _state.update(saved)
        torch.set_num_threads(before)


def use_cpu_threads(params: Optional[int] = None, device: str = "cpu") -> Optional[int]:
    """Set torch's CPU threads by :func:`choose_threads` for a model of ``params`` parameters on ``device``,
    once per command and only inside :func:`chosen_threads`; one line on stderr. Returns the count set."""
    if not _state["enabled"] or _state["done"] or not str(device).startswith("cpu"):
        return None
    import torch

    _state["done"] = True
    try:
        load: Optional[float] = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    n, why = choose_threads(available_cores(), load, params, os.environ.get("OMP_NUM_THREADS"), procs)
    torch.set_num_threads(n)
    if os.environ.get("RANK", "0") == "0":  # one line per run, not per process
        print(f"[flowrl] CPU work on {n} torch thread(s) ({why}; set OMP_NUM_THREADS to choose)", file=sys.stderr,
              flush=True)
    return n


def model_params(module) -> int:
    """Parameters of ``module`` (a torch module), for :func:`use_cpu_threads`."""
    return sum(p.numel() for p in module.parameters())
