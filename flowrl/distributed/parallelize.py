"""Apply a run's :class:`~flowrl.distributed.mesh.ParallelLayout` to its modules: the one place that does it,
for the trainer (:class:`~flowrl.distributed.strategy.ReplicatedStrategy` / ``ShardedStrategy``) and for
``flowrl plan --measure`` alike.

In order, on every module given (the trained transformer first, then frozen copies such as a full
fine-tune's reference):

1. **context parallelism** (``layout.cp > 1``): the forwards split over each context-parallel group, Ulysses
   x ring as the layout says (:func:`flowrl.distributed.context.enable_context_parallel`; one device mesh
   shared by the modules);
2. **FSDP2** (``layout.sharded``): each module sharded per block over every process
   (:func:`flowrl.distributed.fsdp.shard_model`), frozen copies in host memory where ``offload`` says;
3. **process agreement**: a module that routes rows by their content (Wan2.2's two experts run the rows of
   each timestep range) must run the same forwards on every process; it declares
   ``set_process_agreement(agree)`` and gets the layout's rule (:func:`agreement`). The module itself runs
   no collective and reads no degree.

Models stay parallelism-blind: what an adapter needs to know (the token multiple a context-parallel split
needs) it is told by the trainer from the layout (``policy.token_multiple``), never read off a module.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .context import enable_context_parallel
from .fsdp import shard_model
from .mesh import ParallelLayout

Agreement = Callable[[dict, dict, torch.device], dict]  # (rows needed, trained) by route name, device -> which run


def agreement(layout: ParallelLayout) -> Agreement:
    """How the processes of ``layout`` agree on which routes (experts) a forward runs, given the routes each
    process's rows need and the routes that are trained:

    * one process: the routes its rows need;
    * FSDP2 (``sharded``): the union over the processes (one all-reduce of flags): a sharded module's forward
      gathers parameters collectively, so every process must run it;
    * DDP: a differentiable forward also runs every trained route (DDP needs a gradient for every trained
      parameter in every backward; a route without rows runs on one row whose output counts times zero)."""
    if layout.world == 1:
        return lambda need, trained, device: dict(need)
    if layout.sharded:
        def union(need: dict, trained: dict, device: torch.device) -> dict:
            import torch.distributed as dist

            names = list(need)
            flags = torch.tensor([need[n] for n in names], dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            return {n: bool(f) for n, f in zip(names, flags.tolist())}
        return union
    return lambda need, trained, device: {n: need[n] or (torch.is_grad_enabled() and trained.get(n, False))
                                          for n in need}


def parallelize(modules: Sequence[Optional[nn.Module]], layout: ParallelLayout, device: torch.device, *,
                mixed_precision: str = "no", cpu_offload: bool = False, offload_copies: bool = False) -> Optional[object]:
    """Apply ``layout`` to ``modules`` in place (module doc): ``modules[0]`` the trained module, the rest frozen
    copies (``None`` entries skipped). ``cpu_offload``: FSDP2 keeps every shard in host memory;
    ``offload_copies``: the frozen copies' shards only. Collective: every process calls it with the same
    modules. Returns the context-parallel device mesh (None without context parallelism)."""
    mesh = None
    for m in modules:
        if m is not None:
            mesh = enable_context_parallel(m, layout, device, mesh=mesh)
    if layout.sharded:
        for i, m in enumerate(modules):
            if m is not None:
                shard_model(m, device, mixed_precision=mixed_precision,
                            cpu_offload=cpu_offload or (i > 0 and offload_copies))
    agree = agreement(layout)  # a module that routes rows runs what every process runs
    for m in modules:
        for sub in (m.modules() if m is not None else ()):
            if hasattr(sub, "set_process_agreement"):
                sub.set_process_agreement(agree)
    return mesh
