"""The distribution strategy of a run (``train.sharding``), one object picked once by :func:`strategy_for`.

Everything the trainer does differently under DDP and under FSDP2 lives in one of the two classes:

| | :class:`ReplicatedStrategy` (``none``) | :class:`ShardedStrategy` (``fsdp``) |
| --- | --- | --- |
| prepare | ``accelerate.prepare`` (DDP wrapper) | FSDP2 per block (model and frozen copies), no wrapper |
| clip | ``accelerator.clip_grad_norm_`` (unscales fp16) | :func:`flowrl.distributed.fsdp.clip_grad_norm` |
| checkpoint | :class:`~flowrl.checkpoints.unsharded.UnshardedCheckpoint`, main process | :class:`~flowrl.checkpoints.sharded.ShardedCheckpoint`, collective |
| evaluation | main process, bare module (a DDP forward is collective) | every process (forwards are collective) |
| in sync | checksums of the trained tensors gathered | one sharded copy: nothing to diverge |

Both apply the run's :class:`~flowrl.distributed.mesh.ParallelLayout` in :meth:`shard` through the one
:func:`~flowrl.distributed.parallelize.parallelize` (context parallelism, then FSDP2 under ``fsdp``, then the
processes' agreement for modules that route rows); ``layout`` says which data-parallel replica and which
slice of the tokens this process has. Under context parallelism every process evaluates (a forward is
collective over its group).

A strategy is made once the accelerator exists (``strategy_for(train.sharding, accelerator)``).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from ..checkpoints.common import CheckpointError
from ..checkpoints.sharded import ShardedCheckpoint
from ..checkpoints.unsharded import UnshardedCheckpoint
from ..trainable import load_trainable_state, trainable_state
from ..types import swapped_transformer
from .context import attention_heads
from .fsdp import clip_grad_norm
from .mesh import layout_for
from .parallelize import parallelize


class _Strategy:
    """What both strategies share: the process layout, applied to the modules by :meth:`shard`."""

    def __init__(self, acc, train) -> None:
        self.acc, self.train = acc, train
        self.layout = layout_for(acc, train)

    def shard(self, modules: list[Optional[nn.Module]]) -> None:
        """The layout applied in place (:func:`~flowrl.distributed.parallelize.parallelize`): ``modules[0]`` the
        trained model, the rest frozen copies (a full fine-tune's reference; in host memory with
        ``train.offload.reference``). Its Ulysses and ring degrees are chosen here, from the model's heads."""
        if self.layout.cp > 1:
            self.layout = self.layout.with_attention(attention_heads(modules[0]))
        parallelize(modules, self.layout, self.acc.device, mixed_precision=self.train.mixed_precision,
                    cpu_offload=self.train.cpu_offload, offload_copies=bool(self.train.offload.get("reference")))


class ReplicatedStrategy(_Strategy):
    """``train.sharding=none``: every process holds the whole model; DDP averages the gradients."""

    name = "none"

    @property
    def evaluates_here(self) -> bool:
        """Evaluation runs on the main process only (on every process under context parallelism)."""
        return self.acc.is_main_process or self.layout.cp > 1

    def prepare(self, model: nn.Module, optimizer, scheduler) -> tuple[nn.Module, object, object, nn.Module]:
        """``(model, optimizer, scheduler, unwrapped)`` after ``accelerate.prepare`` (the DDP wrapper)."""
        model, optimizer, scheduler = self.acc.prepare(model, optimizer, scheduler)
        return model, optimizer, scheduler, self.acc.unwrap_model(model)

    def clip(self, params: list[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip to total L2 norm ``max_norm`` (fp16 gradients unscaled first); the norm before clipping, a
        0-dim float32 tensor on ``device``."""
        return torch.as_tensor(self.acc.clip_grad_norm_(params, max_norm), dtype=torch.float32, device=device)

    def save(self, root: Path, done: int, *, model, unwrapped, optimizer, scheduler, ema: Optional[dict],
             state: dict, extra: Optional[dict], keep: int) -> None:
        """The main process writes an unsharded checkpoint; every process waits for it."""
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            UnshardedCheckpoint.save(root, done, trainable=trainable_state(unwrapped), optimizer=optimizer.state_dict(),
                                     scheduler=scheduler.state_dict(), ema=ema, extra=extra or None, state=state,
                                     keep=keep)
        self.acc.wait_for_everyone()

    def restore(self, path: Path, *, model, unwrapped, optimizer, ema) -> dict:
        """Read the checkpoint at ``path`` and load its weights, optimizer and EMA (``ema``: the EMA object
        or None) -> the checkpoint dict (``state``, ``scheduler``, ``torch_rng``, ``extra``)."""
        ck = UnshardedCheckpoint.load(path)
        load_trainable_state(unwrapped, ck["trainable"])
        optimizer.load_state_dict(ck["optimizer"])
        if ema is not None and ck["ema"] is not None:
            ema.shadow = ck["ema"]
        return ck

    def evaluation_model(self, policy, unwrapped: nn.Module) -> contextlib.AbstractContextManager:
        """Inside, ``policy`` runs the bare module: a DDP forward broadcasts buffers, a collective the
        processes that do not evaluate would never join."""
        return swapped_transformer(policy, unwrapped)

    def in_sync(self, unwrapped: nn.Module) -> bool:
        """Whether every process holds the same trained weights (collective: sum and sum of squares of the
        trained tensors gathered over processes, compared exactly)."""
        with torch.no_grad():
            ps = [p.detach().double() for p in unwrapped.parameters() if p.requires_grad]
            sig = torch.stack([sum(p.sum() for p in ps), sum((p * p).sum() for p in ps)]).view(1, 2)
        if self.acc.num_processes == 1:
            return True
        allsig = self.acc.gather(sig.to(self.acc.device)).cpu()  # [world, 2]
        return bool(torch.allclose(allsig, allsig[:1].expand_as(allsig), rtol=0, atol=0))


class ShardedStrategy(_Strategy):
    """``train.sharding=fsdp``: the transformer FSDP2-sharded per block over the processes
    (:mod:`flowrl.distributed.fsdp`); the EMA and frozen copies are shards too."""

    name = "fsdp"

    @property
    def evaluates_here(self) -> bool:
        """Every process evaluates: the sharded forwards are collective (the main process writes)."""
        return True

    def prepare(self, model: nn.Module, optimizer, scheduler) -> tuple[nn.Module, object, object, nn.Module]:
        """Unchanged (not through ``accelerate.prepare``, which would wrap the sharded model in DDP)."""
        return model, optimizer, scheduler, model

    def clip(self, params: list[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
        """Clip the sharded gradients to total L2 norm ``max_norm``; the norm before clipping on ``device``."""
        return clip_grad_norm(params, max_norm).to(device)

    def save(self, root: Path, done: int, *, model, unwrapped, optimizer, scheduler, ema: Optional[dict],
             state: dict, extra: Optional[dict], keep: int) -> None:
        """Every process writes its shards (collective)."""
        ShardedCheckpoint.save(root, done, model=model, optimizer=optimizer, scheduler=scheduler.state_dict(),
                               state=state, ema=ema, extra=extra or {}, keep=keep,
                               is_main=self.acc.is_main_process, barrier=self.acc.wait_for_everyone)

    def restore(self, path: Path, *, model, unwrapped, optimizer, ema) -> dict:
        """Restore the shards of the weights, optimizer and EMA in place (collective, any number of
        processes) -> ``state``, ``scheduler``, ``torch_rng``, ``extra``."""
        if not ShardedCheckpoint.is_one(path):
            raise CheckpointError(f"{path} is not a sharded checkpoint (written with train.sharding=none)")
        return ShardedCheckpoint.restore(path, model=model, optimizer=optimizer,
                                         ema=ema.shadow if ema is not None else None)

    def evaluation_model(self, policy, unwrapped: nn.Module) -> contextlib.AbstractContextManager:
        """The FSDP module itself, evaluated on every process."""
        return contextlib.nullcontext()

    def in_sync(self, unwrapped: nn.Module) -> bool:
        """One copy of the weights exists, split over the processes: nothing can diverge."""
        return True


STRATEGIES = {ReplicatedStrategy.name: ReplicatedStrategy, ShardedStrategy.name: ShardedStrategy}
SHARDINGS = tuple(STRATEGIES)  # train.sharding values


def strategy_for(sharding: str, acc, train):
    """The strategy object of ``train.sharding`` for accelerator ``acc`` and the ``train`` config."""
    try:
        return STRATEGIES[sharding](acc, train)
    except KeyError:
        raise ValueError(f"train.sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}") from None


@contextlib.contextmanager
def evaluation_weights(strategy, policy, unwrapped: nn.Module, ema) -> Iterator[None]:
    """Inside, ``policy`` evaluates the evaluation weights: the EMA when kept (loaded into the module,
    then restored), through the strategy's evaluation module."""
    with (ema.applied(unwrapped) if ema is not None else contextlib.nullcontext()), \
            strategy.evaluation_model(policy, unwrapped):
        yield
