"""The process layout of a run: data-parallel replicas x context-parallel groups (``train.context_parallel``).

``N`` processes with context-parallel degree ``C`` form ``D = N / C`` data-parallel replicas. Ranks
``d C .. d C + C - 1`` are replica ``d``'s context-parallel group (contiguous ranks: on GPUs the group
sits inside a node, where the all-to-all of every attention layer is fastest). A group is one replica:
its ranks draw the same prompts and noise, sample the same rollout (each rank computing a slice of
every transformer forward's tokens) and train on the same minibatches; so the prompts, the rollout
seed and the data of an offline step are indexed by the replica (``dp_rank`` of ``dp_size``), and the
statistics gathered over processes keep one copy per replica (:meth:`ParallelLayout.replica_rows`).

FSDP2 (``train.sharding=fsdp``) shards over all ``N`` processes: the ranks of a group hold the same
model, so splitting its parameters over them too costs nothing extra and divides the resident state by
``N`` (the "FSDP degree" ``D`` is the data-parallel one; the mesh is ``D x C``). DDP (``none``)
all-reduces over all ``N``. Either way a gradient is averaged over the ``N`` processes; the
context-parallel output gather's adjoint (:mod:`flowrl.distributed.context`) makes that average the
data-parallel mean (docs/cluster.md).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError

CP_ATTENTION = ("auto", "ulysses", "ring")  # train.context_parallel_attention


@dataclass(frozen=True)
class ParallelLayout:
    """Every degree of a run in one record: ``world`` processes as ``dp_size`` data-parallel replicas of ``cp``
    ranks each (a context-parallel group splitting every forward's tokens: ``ulysses`` x ``ring``, known once
    the model's attention heads are, :meth:`with_attention`); the replicas' copies of the model are whole
    (``sharded`` False: DDP replication, ``dp_replicate = dp_size``) or FSDP2 shards over all ``world``
    processes (``dp_shard = world``). This process is ``rank``. Built and checked in one place,
    :meth:`of`; the trainer and ``flowrl plan`` (``--measure`` included) apply it with one function,
    :func:`flowrl.distributed.parallelize.parallelize`."""

    world: int = 1
    rank: int = 0
    cp: int = 1
    sharded: bool = False
    attention: str = "auto"  # train.context_parallel_attention: how cp splits into Ulysses x ring
    ulysses: int = 0  # 0: not chosen yet (the model's heads decide: with_attention)
    ring: int = 0

    def __post_init__(self):
        if self.cp < 1 or self.world % self.cp:
            raise ConfigError(f"train.context_parallel={self.cp} must divide the number of processes ({self.world}): "
                              f"launch a multiple of {self.cp} processes, or set train.context_parallel to a divisor "
                              f"of {self.world}")
        if self.ulysses and self.ulysses * self.ring != self.cp:
            raise ConfigError(f"Ulysses {self.ulysses} x ring {self.ring} must be train.context_parallel={self.cp}")

    @classmethod
    def of(cls, train, world: int, rank: int = 0, heads: Optional[int] = None) -> "ParallelLayout":
        """The layout of ``world`` processes under the ``train`` settings (``context_parallel``, its attention,
        ``sharding``), checked as a whole: the settings alone (:func:`check_parallel_settings`), the process
        count, and with the model's attention ``heads`` the Ulysses and ring degrees. One ``ConfigError`` line."""
        check_parallel_settings(train)
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ConfigError(f"the number of processes must be a positive integer, got {world!r}")
        layout = cls(world, rank, int(train.context_parallel), sharded=train.sharding == "fsdp",
                     attention=train.context_parallel_attention)
        return layout if heads is None else layout.with_attention(heads)

    def with_attention(self, heads: int) -> "ParallelLayout":
        """This layout with its Ulysses and ring degrees for a model of ``heads`` attention heads
        (:func:`attention_degrees` under ``attention``)."""
        ulysses, ring = attention_degrees(heads, self.cp, self.attention)
        return dataclasses.replace(self, ulysses=ulysses, ring=ring)

    @property
    def dp_replicate(self) -> int:
        """Replicas holding whole copies of the model (DDP): the data-parallel degree, 1 when sharded."""
        return 1 if self.sharded else self.dp_size

    @property
    def dp_shard(self) -> int:
        """Processes each parameter is split over (FSDP2): all of them when sharded, else 1."""
        return self.world if self.sharded else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas (context-parallel groups)."""
        return self.world // self.cp

    @property
    def dp_rank(self) -> int:
        """This process's replica."""
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        """This process's place in its context-parallel group (which slice of the tokens it computes)."""
        return self.rank % self.cp

    def replica_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """Rows gathered from every process (``[world * n, ...]``, rank order) -> one copy per replica
        (``[dp_size * n, ...]``, replica order): the ranks of a group hold equal rows."""
        if self.cp == 1:
            return gathered
        per = gathered.reshape(self.world, -1, *gathered.shape[1:])  # [world, n, ...]
        return per[:: self.cp].reshape(-1, *gathered.shape[1:])  # [dp_size * n, ...]


def layout_for(acc, train) -> ParallelLayout:
    """The layout of accelerator ``acc``'s processes under the ``train`` settings (:meth:`ParallelLayout.of`)."""
    return ParallelLayout.of(train, acc.num_processes, acc.process_index)


def attention_degrees(heads: int, cp: int, mode: str = "auto") -> tuple[int, int]:
    """``(ulysses, ring)`` degrees with ``ulysses x ring = cp``: ``ulysses`` all of ``cp`` (it must divide
    ``heads``), ``ring`` all of it, or ``auto``: Ulysses over ``gcd(heads, cp)``, ring attention over the rest."""
    if mode == "ring":
        return 1, cp
    u = math.gcd(heads, cp)
    if mode == "ulysses" and u != cp:
        raise ConfigError(f"train.context_parallel_attention=ulysses: {heads} attention heads do not divide over "
                          f"{cp} processes; use auto (Ulysses over {u}, ring attention over {cp // u}) or ring")
    return u, cp // u


def check_parallel_settings(train) -> None:
    """One-line errors for ``train.context_parallel`` / ``context_parallel_attention`` (config validation;
    the process count is checked when the run starts); ``train.offload`` validated and completed
    (:func:`flowrl.distributed.offload.offload_settings`)."""
    from .offload import offload_settings

    train.offload = offload_settings(train).as_dict()
    cp = train.context_parallel
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError(f"train.context_parallel must be a positive integer (processes per context-parallel "
                          f"group; 1 = off), got {cp!r}")
    if train.context_parallel_attention not in CP_ATTENTION:
        raise ConfigError(f"train.context_parallel_attention must be one of {', '.join(CP_ATTENTION)}, got "
                          f"{train.context_parallel_attention!r}")
    if cp > 1 and train.mixed_precision == "fp16":
        raise ConfigError("train.context_parallel > 1 supports train.mixed_precision 'no' or 'bf16' (fp16 loss "
                          "scaling is per process); use bf16")


def cp_refusal(pipeline: str, train) -> str:
    """Why ``train.context_parallel > 1`` cannot run on the model of ``pipeline`` ("" when it can or is 1): its
    adapter's own declaration (``context_parallel_refusal``, pipelines/facts.py; LTX-2's), a one-line error of the
    config's cross-section rules. A transformer without a plan is refused when the plan is applied
    (:func:`flowrl.distributed.context.cp_plan`)."""
    from ..pipelines import policy_class

    refusal = getattr(policy_class(pipeline), "context_parallel_refusal", "") if train.context_parallel > 1 else ""
    return f"train.context_parallel={train.context_parallel}: {refusal}; set train.context_parallel=1" if refusal else ""


def device_mesh(layout: ParallelLayout, device: torch.device, ulysses: int, ring: int) -> Optional[object]:
    """The ``(dp, ring, ulysses)`` device mesh of ``layout`` (``ring x ulysses = cp``), or None without
    context parallelism. Collective: every process calls it."""
    if layout.cp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if ring * ulysses != layout.cp:
        raise ValueError(f"ring {ring} x ulysses {ulysses} != context_parallel {layout.cp}")
    return init_device_mesh(device.type, (layout.dp_size, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
