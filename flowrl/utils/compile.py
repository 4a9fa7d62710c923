"""``model.compile``: ``torch.compile`` of the transformer forward every rollout runs, and its recompiles counted.

:func:`compile_rollouts` installs, in place, a forward on a transformer module that runs a
``torch.compile``d call (whole graph where the model allows, ``dynamic=False``: shapes static, one graph
per batch size and resolution) whenever no gradient is taken, and the module's own eager call otherwise:

* compiled: sampling (the policy with its LoRA active), Sol-RL's exploration copy (compiled too when
  :class:`~flowrl.quant.sync.QuantizedCopy` builds it) and its regeneration, evaluation, ``flowrl sample``
  and ``flowrl eval``;
* eager: every differentiable forward (training), and any forward inside :func:`eager_forwards` (the
  trainer's update, whose no-gradient forwards -- the KL reference, an old policy -- run at minibatch
  sizes that change from iteration to iteration).

The module keeps its parameters, names, state dict and adapters: a LoRA step or a re-sync that changes
weights in place runs the compiled graph again without recompiling. A deep copy of the module is eager
(``copy.deepcopy`` never carries the compiled call to a copy of other weights).

Recompiles are counted in a :class:`CompileLog` (shared by a policy and its exploration copy): a call
that made dynamo compile (``torch._dynamo.utils.counters["frames"]["total"]`` grew) is the first compile
of its role (``policy``, ``exploration``) or a recompile; the cause is dynamo's guard failure
(``torch._dynamo.utils.guard_failures``), e.g. ``tensor 'args[0]' size mismatch at index 0. expected 8,
actual 4``.

``FLOWRL_COMPILE_BACKEND`` (default ``inductor``) names dynamo's backend: ``aot_eager`` captures the same
graphs and guards without generating code (a fault of the code generator or of the capture; the CPU
tests use it where inductor's C++ compile would take minutes).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor records CUDA graphs in these on a GPU
BACKEND_ENV = "FLOWRL_COMPILE_BACKEND"
RECOMPILE_LIMIT = 64  # graphs per compiled code (dynamo's default 8 is shared by every module compiled here)
_eager = threading.local()


def check_mode(mode: Any, where: str = "model.compile") -> str:
    """``mode`` if it is one of :data:`COMPILE_MODES`, else a ValueError in one line."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"{where} must be one of {', '.join(COMPILE_MODES)} (off: eager; reduce-overhead adds CUDA "
                         f"graphs), got {mode!r}")
    return mode


def compile_backend() -> str:
    """dynamo's backend: ``$FLOWRL_COMPILE_BACKEND`` or ``inductor``."""
    return os.environ.get(BACKEND_ENV, "").strip() or "inductor"


@contextlib.contextmanager
def eager_forwards(on: bool = True) -> Iterator[None]:
    """Inside (this thread), compiled forwards run eagerly (the trainer's update); ``on=False`` changes nothing
    (a caller told whether to run compiled: ``eager_forwards(not compiled)``)."""
    if not on:
        yield
        return
    depth = getattr(_eager, "depth", 0)
    _eager.depth = depth + 1
    try:
        yield
    finally:
        _eager.depth = depth


@dataclass
class CompileLog:
    """Compiles of the compiled forwards that share it: ``recompiles`` (cumulative), each recompile's
    ``(role, cause)`` in ``events``, ``compiles`` (first compiles, one per role) and the wall seconds of
    the calls that compiled (``compile_seconds``: compile plus one forward)."""

    compiles: int = 0
    recompiles: int = 0
    compile_seconds: float = 0.0
    events: list = field(default_factory=list)
    _roles: set = field(default_factory=set)
    _reported: int = 0

    def record(self, role: str, seconds: float, cause: str) -> None:
        self.compile_seconds += seconds
        if role in self._roles:
            self.recompiles += 1
            self.events.append((role, cause))
        else:
            self._roles.add(role)
            self.compiles += 1

    def after_unit(self, unit: str, i: int, first: int, warn: bool = True) -> int:
        """The cumulative recompiles after ``unit`` ``i``; one warning line on stderr per recompile since the last
        call when ``i`` is not the run's ``first`` unit (the first compiles every shape it meets)."""
        import sys

        new, self._reported = self.events[self._reported:], len(self.events)
        if warn and i > first:
            for role, cause in new:
                print(f"[flowrl] WARNING: {unit} {i}: the compiled transformer forward ({role}) recompiled: {cause} "
                      f"({self.recompiles} recompiles so far; each costs a compile: keep batch sizes fixed from one "
                      f"{unit} to the next, or set model.compile=off)", file=sys.stderr, flush=True)
        return self.recompiles


def _run(module: nn.Module, *args, **kwargs):
    """The module's own call (hooks included): what the compiled forward traces."""
    return module._call_impl(*args, **kwargs)


_COMPILED: dict = {}


def _compiled_run(mode: str, backend: str):
    """One ``torch.compile(_run)`` per (mode, backend), shared by every module compiled so (dynamo's graphs live on
    ``_run``'s code either way: a new module of the same structure, shapes and mode reuses them)."""
    key = (mode, backend)
    if key not in _COMPILED:
        kw = {"mode": None if mode == "default" else mode} if backend == "inductor" else {}
        _COMPILED[key] = torch.compile(_run, backend=backend, dynamic=False, **kw)
    return _COMPILED[key]


def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def _failures() -> list:
    from torch._dynamo import utils

    return getattr(utils, "guard_failures", {}).get(_run.__code__, [])


def _cause(reasons: list) -> str:
    """dynamo's first guard failure in one line (``0/1: `` prefix, comments and stack dropped)."""
    if not reasons:
        return "no guard failed (a new graph after a graph break, or dynamo's recompile limit)"
    line = str(reasons[0]).strip().splitlines()[0]
    line = re.sub(r"^\d+/\d+: ", "", line).split("  #")[0].strip()
    return line[:240]


class RolloutForward:
    """The call :func:`compile_rollouts` installs as ``module._compiled_call_impl`` (module doc)."""

    def __init__(self, module: nn.Module, mode: str, role: str, log: CompileLog, backend: str):
        self.mode, self.role, self.log, self.backend = mode, role, log, backend
        self._module = weakref.ref(module)  # no reference cycle: a dropped copy frees its memory at once
        self._compiled = _compiled_run(mode, backend)

    def __call__(self, *args, **kwargs):
        module = self._module()
        if torch.is_grad_enabled() or getattr(_eager, "depth", 0) or torch.compiler.is_compiling():
            return module._call_impl(*args, **kwargs)
        graphs = self.mode in CUDA_GRAPH_MODES and torch.cuda.is_available()
        if graphs:  # CUDA graphs: each call a new step, whose replay reuses the last outputs' memory
            torch.compiler.cudagraph_mark_step_begin()
        frames, seen, t0 = _frames(), len(_failures()), time.perf_counter()
        out = self._compiled(module, *args, **kwargs)
        if _frames() != frames:
            self.log.record(self.role, time.perf_counter() - t0, _cause(_failures()[seen:]))
        if graphs:
            out = tree_map_only(torch.Tensor, torch.clone, out)  # [B, ...] kept past the next step
        return out

    def __deepcopy__(self, memo) -> None:
        return None  # a copy of the module is eager (its own weights; compile it on its own)

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(int(getattr(cfg, name)), RECOMPILE_LIMIT))


def _quiet_cpp_extension() -> None:
    """Import ``torch.utils.cpp_extension`` once with its "No CUDA runtime is found" warning silenced (a CPU
    machine with ``CUDA_HOME`` set: inductor imports it at its first compile)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        log.setLevel(level)


def compiled_forward(module: nn.Module) -> Optional[RolloutForward]:
    """The compiled forward installed on ``module`` (None: eager)."""
    impl = getattr(module, "_compiled_call_impl", None)
    return impl if isinstance(impl, RolloutForward) else None


def compile_log(module: nn.Module) -> CompileLog:
    """The :class:`CompileLog` of ``module``'s compiled forward (an empty one when it is eager)."""
    fwd = compiled_forward(module)
    return fwd.log if fwd is not None else CompileLog()


def compile_rollouts(module: nn.Module, mode: str, role: str = "policy", log: Optional[CompileLog] = None,
                     backend: Optional[str] = None) -> CompileLog:
    """Compile ``module``'s no-gradient forward with ``mode`` in place (module doc); ``"off"`` removes it.
    Returns the :class:`CompileLog` that counts its recompiles (``log``, or a new one)."""
    check_mode(mode)
    log = log if log is not None else CompileLog()
    if mode == "off":
        if compiled_forward(module) is not None:
            module._compiled_call_impl = None
        return log
    backend = backend or compile_backend()
    _raise_recompile_limit()
    if not torch.cuda.is_available():
        _quiet_cpp_extension()
    module._compiled_call_impl = RolloutForward(module, mode, role, log, backend)
    return log


def compile_like(copy: nn.Module, source: nn.Module, role: str) -> nn.Module:
    """Compile ``copy`` as ``source`` is compiled (same mode, backend and log; nothing when ``source`` is eager)."""
    fwd = compiled_forward(source)
    if fwd is not None:
        compile_rollouts(copy, fwd.mode, role, fwd.log, fwd.backend)
    return copy


@torch.no_grad()
def load_in_place(dst: nn.Module, src: nn.Module) -> bool:
    """Copy every parameter and buffer of ``src`` into ``dst``'s own tensors when the two have the same names,
    shapes, dtypes and tensor types (a re-sync that keeps ``dst``'s compiled graphs and CUDA-graph inputs);
    False (nothing copied) when they differ."""
    def tensors(m: nn.Module) -> dict:
        return {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers(remove_duplicate=False))}

    a, b = tensors(dst), tensors(src)
    same = a.keys() == b.keys() and all(type(a[k]) is type(b[k]) and a[k].shape == b[k].shape
                                        and a[k].dtype == b[k].dtype for k in a)
    if not same:
        return False
    for k, t in a.items():
        t.copy_(b[k])
    return True


__all__ = ["BACKEND_ENV", "COMPILE_MODES", "CompileLog", "RolloutForward", "check_mode", "compile_backend",
           "compile_like", "compile_log", "compile_rollouts", "compiled_forward", "eager_forwards", "load_in_place"]
