"""The int8 GEMM kernels behind ``int8-dynamic`` (:mod:`flowrl.quant.int8`): the fixed-scale
oneDNN / fbgemm calls, the probes that say which of them run here, and the per-copy scratch
(:class:`SharedInput`) that lets layers share one prepared input.
"""
from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any, Optional

import torch

LEVELS = 63  # activation codes ZERO_POINT +- LEVELS: [1, 127], 7 bits (no int16 saturation in fbgemm's AVX2 kernel)
ZERO_POINT = 64
KERNELS = ("onednn", "fbgemm", "sentinel")  # per_row / static GEMM paths, fastest first ("auto": the first that works)
PARALLEL_PASS_NUMEL = 1 << 22  # element-wise passes over tensors this big (16 MB fp32) keep all threads


def _qdq_linear(x: torch.Tensor, scale: float, packed) -> torch.Tensor:
    """fbgemm: quantize ``x`` [N, I] (float32, contiguous) with ``scale`` and zero point 64 while
    packing it, uint8 x int8 GEMM with int32 accumulation, float output [N, O] (+ packed bias)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, scale, ZERO_POINT, packed)


def _uint8_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(round(x / scale) + 64, 0, 255)`` as a plain uint8 tensor [N, I] (x float32, contiguous):
    torch's vectorized per-tensor quantizer, its bytes re-viewed through the storage (no copy)."""
    q = torch.quantize_per_tensor(x, scale, ZERO_POINT, torch.quint8)
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def _onednn_linear(u: torch.Tensor, scale: float, packed, w_scale: torch.Tensor, w_zp: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN: uint8 codes ``u`` [N, I] (zero point 64, step ``scale``) x int8 weights, int32
    accumulation, float output ``scale * w_scale[j] * sum (u - 64) w + bias`` [N, O]."""
    return torch.ops.onednn.qlinear_pointwise(u, scale, ZERO_POINT, packed, w_scale, w_zp, bias, 1.0, 0,
                                              torch.float32, "none", [], "")


class _OneThread:
    """Run the block's element-wise passes on the calling thread only (intra-op threads back after).

    A pass over a few megabytes takes well under a millisecond on one core, but as a parallel
    region it waits for every worker thread; on a busy machine a descheduled worker costs a
    scheduler time slice (milliseconds) per region, which made four small passes per layer cost
    more than the int8 GEMM saved. The GEMMs keep all threads, and so do passes over tensors of
    ``PARALLEL_PASS_NUMEL`` elements or more (``parallel=True``), where a second core saves more
    than a region risks.

    Only on the main thread: there ``torch.set_num_threads`` leaves the other threads' counts
    alone, but called from another thread it can leave the main thread at one thread for good
    (libgomp), so other threads run the passes as ordinary parallel ops.
    """

    __slots__ = ("active", "n")

    def __init__(self, parallel: bool = False) -> None:
        self.active = not parallel and threading.current_thread() is threading.main_thread()
        self.n = 1

    def __enter__(self) -> None:
        if self.active:
            self.n = torch.get_num_threads()
            if self.n > 1:
                torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        if self.n > 1:
            torch.set_num_threads(self.n)


@functools.lru_cache(maxsize=None)
def _kernel_problem() -> Optional[str]:
    """None if fbgemm's dynamic int8 Linear runs here, else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_tensor(torch.ones(4, 4), 1.0 / 127, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qw, None)
            torch.ops.quantized.linear_dynamic(torch.ones(2, 4), packed, True)
    except Exception as e:  # noqa: BLE001 - any failure means the kernel is unusable here
        return (f"torch {torch.__version__} has no working dynamic int8 Linear kernel "
                f"(torch.ops.quantized.linear_dynamic: {type(e).__name__}: {e})")
    return None


def _probe(kernel: str) -> bool:
    """Whether ``kernel`` runs here and gives the hand-computed result on a small case."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.25, -1.0]])  # [2, 3]
        b = torch.tensor([1.0, -1.0])
        s = (w.abs().amax(dim=1) / 127.0).double()
        qw = torch.quantize_per_channel(w, s, torch.zeros(2, dtype=torch.long), 0, torch.qint8)
        x = torch.tensor([[1.0, 0.3, -1.0], [0.0, -0.45, 0.7]])  # [2, 3], no rounding ties
        if kernel == "fbgemm":
            y = _qdq_linear(x, 1.0 / LEVELS, torch.ops.quantized.linear_prepack(qw, b))
        else:
            packed = torch.ops.onednn.qlinear_prepack(qw.int_repr(), None)
            y = _onednn_linear(_uint8_codes(x, 1.0 / LEVELS), 1.0 / LEVELS, packed, s.float(),
                               torch.zeros(2, dtype=torch.long), b)
        xq = torch.round(x.double() * LEVELS) / LEVELS  # what the kernel multiplies
        ref = xq @ (qw.int_repr().double() * s[:, None]).t() + b.double()
        return bool(torch.allclose(y.double(), ref, atol=1e-4))


@functools.lru_cache(maxsize=None)
def kernel_available(kernel: str) -> bool:
    """Whether the ``"onednn"`` / ``"fbgemm"`` fixed-scale kernel works here (``"sentinel"``:
    whenever int8-dynamic does)."""
    if kernel == "sentinel":
        return _kernel_problem() is None
    try:
        return _probe(kernel)
    except Exception:  # noqa: BLE001 - missing op, or an engine without it: not available
        return False


def resolve_kernel(kernel: str = "auto") -> str:
    """``"auto"``: the fastest of :data:`KERNELS` that works here; a named one must work here."""
    if kernel == "auto":
        return next(k for k in KERNELS if kernel_available(k))
    if kernel not in KERNELS:
        raise ValueError(f"int8-dynamic kernel must be 'auto' or one of {KERNELS}, got {kernel!r}")
    if not kernel_available(kernel):
        working = [k for k in KERNELS if kernel_available(k)]
        raise ValueError(f"int8-dynamic kernel {kernel!r} does not run with torch {torch.__version__} here; "
                         f"these do: {', '.join(working)} (or 'auto')")
    return kernel


class SharedInput:
    """Per-thread scratch of one quantized copy, shared by its int8 layers.

    - a workspace that every layer writes its prepared input into (scaled rows, or the clamped
      input): no fresh multi-megabyte allocation per layer call, so no page faults and zeroed
      pages each time the allocator has handed memory back to the OS;
    - a memo of the last prepared input, ``(weakref to the input, its version counter, key,
      prepared tensors)``, read and written as one tuple: layers fed the very same tensor object,
      not modified in place since, reuse its preparation (inference tensors have no version
      counter: never memoized).

    The workspace is kept between calls (one float32 tensor the size of the largest quantized
    layer input seen): freeing it after each forward cost more page faults than it saved.
    :meth:`release` frees both. Copies and pickles of a module get a fresh, empty one.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def __reduce__(self):
        return (SharedInput, ())

    def get(self, x: torch.Tensor, key: Any) -> Optional[tuple]:
        e = getattr(self._local, "entry", None)
        if e is not None and e[0]() is x and e[2] == key and not x.is_inference() and e[1] == x._version:
            return e[3]
        return None

    def put(self, x: torch.Tensor, key: Any, value: tuple) -> None:
        self._local.entry = None if x.is_inference() else (weakref.ref(x), x._version, key, value)

    def workspace(self, rows: int, cols: int) -> torch.Tensor:
        """A float32 [rows, cols] scratch tensor; invalidates the memo (it may live there)."""
        self._local.entry = None
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < rows * cols:
            self._local.buf = buf = None  # free the old one first
            self._local.buf = buf = torch.empty(rows * cols, dtype=torch.float32)
        return buf[: rows * cols].view(rows, cols)

    def release(self) -> None:
        self._local.entry = None
        self._local.buf = None
