"""Memory of a computation measured on meta tensors: the live bytes an allocator without caching would hold.

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every aten op (forward and backward): each
output tensor with a storage not seen before is an allocation of ``storage.nbytes()``; the
allocation is freed when the last tensor on that storage dies (``weakref.finalize`` per tensor, a
reference count per storage). Outputs that alias an input created outside the block (in-place ops
on parameters, views of the inputs) are not allocations. ``peak`` is the high-water mark of the
live bytes above what existed when the block began; it matches the CPU allocator's own count
(``torch.profiler`` ``Total Allocated``) on real tensors.

While it runs, a ``saved_tensors_hooks`` pair keeps every tensor autograd saves as its Python
object (so its storage is counted while saved), and sums the distinct saved storages
(``saved_bytes``: the activations kept for backward, each storage once).

:func:`flash_attention` routes ``F.scaled_dot_product_attention`` to the fused attention kernel
(saves the output and a log-sum-exp, never the ``[B, H, L, L]`` matrix), as CUDA's flash /
memory-efficient kernels and the CPU kernel do, also with an additive ``[B, H, L_q, L_k]`` (broadcast)
mask such as SANA's cross-attention padding mask; on meta tensors PyTorch would otherwise take the
math path and count the attention matrix. Boolean masks keep the math path.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors allocated inside the block and still alive: ``live``, ``peak`` (bytes)."""

    def __init__(self):
        super().__init__()
        self.count: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._saved: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.count[key] -= 1
        if self.count[key] == 0:
            self.live -= self.size.pop(key)
            del self.count[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            key = _key(t)
            if key not in self.count:
                if key in inputs:  # in-place op or view on a tensor made outside the block
                    continue
                nbytes = t.untyped_storage().nbytes()
                self.count[key], self.size[key] = 0, nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self.count[key] += 1
            weakref.finalize(t, self._release, key)
        return out

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key in self.count:  # made in the block (parameters and inputs are not activations)
            self._saved.setdefault(key, self.size[key])
        return t

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct storages autograd saved for backward in the block."""
        return sum(self._saved.values())

    @contextlib.contextmanager
    def tracking(self) -> Iterator["LiveBytes"]:
        """The dispatch mode plus the saved-tensor hooks (see module doc)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), self:
            yield self


_ORIGINAL_SDPA = F.scaled_dot_product_attention


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    if kw.get("enable_gqa") or (attn_mask is not None and (attn_mask.dtype == torch.bool or attn_mask.dim() != 4)):
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, **kw)
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return fused(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]  # [B, H, L, d]


@contextlib.contextmanager
def flash_attention() -> Iterator[None]:
    """Within the block, unmasked ``F.scaled_dot_product_attention`` runs the fused kernel (module doc)."""
    F.scaled_dot_product_attention = _fused_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
