"""The exploration copy of a policy's transformer, kept in step with the trained weights.

Sol-RL step 5 (arXiv 2604.06916): after each update the quantized copy must follow the
trained weights. :class:`QuantizedCopy` re-quantizes (LoRA merged into a fresh copy, then
quantized and calibrated) whenever the trained module changed since the last sync, and
times it. Change detection is a fingerprint of every parameter and buffer's identity and
in-place version counter (an optimizer step, ``load_state_dict`` or ``copy_`` bumps it) plus
the LoRA adapters' enabled/active state: cheap, with no tensor compared.

When the trained module's rollout forward is compiled (``model.compile``, :mod:`flowrl.utils.compile`), the
copy is compiled the same way (role ``exploration``, the policy's recompile log; not a backend that declares
``compilable = False``: ``int8-dynamic``'s fbgemm kernels cannot be traced), and a re-sync of a backend
whose copies hold all their state in tensors (``syncs_in_place``: ``fp8``, ``none``) copies the new copy's
tensors into the compiled one: its graphs (and CUDA graphs' inputs) stay valid, nothing recompiles. That
holds the old copy and the new one at once during the sync (one more copy's memory at its peak).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

from torch import nn

from ..types import swapped_transformer
from ..utils.compile import compile_like, compiled_forward, load_in_place
from .common import unwrap_model

__all__ = ["QuantizedCopy", "fingerprint"]


def fingerprint(module: nn.Module) -> tuple:
    """Changes whenever a parameter/buffer of ``module`` is replaced or modified in place, or an
    adapter is enabled, disabled or switched."""
    m = unwrap_model(module)
    tensors = tuple((n, t.data_ptr(), t._version) for n, t in m.named_parameters())
    tensors += tuple((n, t.data_ptr(), t._version) for n, t in m.named_buffers())
    adapters = tuple((n, bool(getattr(s, "disable_adapters", False)), tuple(getattr(s, "active_adapters", ()) or ()))
                     for n, s in m.named_modules() if hasattr(s, "lora_A"))
    return tensors + adapters


class QuantizedCopy:
    """A quantizer's private copy of a transformer, re-synced when the source changes.

    ``sync(transformer, calibrate)`` returns the seconds it spent (0.0 when nothing changed);
    ``syncs``, ``last_sync_seconds`` and ``total_sync_seconds`` keep the record.
    """

    def __init__(self, quantizer):
        self.quantizer = quantizer
        self.module: Optional[nn.Module] = None
        self._fingerprint: Optional[tuple] = None
        self.syncs = 0
        self.last_sync_seconds = 0.0
        self.total_sync_seconds = 0.0

    def stale(self, transformer: nn.Module) -> bool:
        return self.module is None or fingerprint(transformer) != self._fingerprint

    def sync(self, transformer: nn.Module, calibrate: Optional[Callable[[nn.Module], None]] = None,
             force: bool = False) -> float:
        """Re-quantize ``transformer`` if it changed (or ``force``); returns seconds spent."""
        if not force and not self.stale(transformer):
            return 0.0
        t0 = time.perf_counter()
        source = unwrap_model(transformer)
        compiled = compiled_forward(source) is not None and getattr(self.quantizer, "compilable", True)
        in_place = compiled and getattr(self.quantizer, "syncs_in_place", False)
        if not in_place:
            self.module = None  # drop the old copy before building the new one
        fp = fingerprint(transformer)
        need = getattr(self.quantizer, "needs_calibration", True)
        fresh = self.quantizer.quantize(transformer, calibrate if need else None)
        if not (in_place and self.module is not None and load_in_place(self.module, fresh)):
            self.module = compile_like(fresh, source, "exploration") if compiled else fresh
        del fresh
        self._fingerprint = fp
        dt = time.perf_counter() - t0
        self.syncs += 1
        self.last_sync_seconds = dt
        self.total_sync_seconds += dt
        return dt

    @contextlib.contextmanager
    def active(self, policy) -> Iterator[None]:
        """Inside, ``policy.velocity`` runs the quantized copy (call :meth:`sync` first)."""
        if self.module is None:
            raise RuntimeError("QuantizedCopy.active before sync(): nothing to explore with yet")
        with swapped_transformer(policy, self.module):
            yield
