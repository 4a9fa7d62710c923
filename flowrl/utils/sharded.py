"""FSDP2-sharded modules seen from outside the trainer: recognising one, a tensor gathered whole or kept in host
memory shard by shard, and an unsharded copy of a module.

Under ``train.sharding=fsdp`` (``flowrl.distributed.fsdp``) each process holds a shard of every
parameter (a ``DTensor``). Code that needs the whole model on one process (the low-precision
exploration copy of the Sol sampler) asks :func:`unsharded_copy`, a collective call: every process
must make it, in the same order, as they make every forward pass of a sharded model.
"""
from __future__ import annotations

import torch
from torch import nn


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was passed to FSDP2's ``fully_shard`` (its parameters are shards)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor`` gathered from every process (collective), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory; a ``DTensor`` (FSDP shard) stays a ``DTensor`` of the same mesh and placements
    with its local shard in host memory (as FSDP2's CPU offload keeps its shards)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor.from_local(t.to_local().to("cpu"), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.to("cpu")


def _unsharded_class(module: nn.Module) -> type:
    """The model class under FSDP2's dynamic ``FSDP<Class>`` subclass."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))


@torch.no_grad()
def unsharded_copy(module: nn.Module) -> nn.Module:
    """A new, unsharded module equal to the sharded ``module`` (collective: every process calls it).

    The parameters are gathered whole (``get_model_state_dict(full_state_dict=True)``) into a model
    built on the meta device from ``module.config`` (diffusers models) with the same peft adapters,
    so no second random initialisation runs; buffers (never sharded by FSDP2) are cloned. The copy
    lives where the shards' compute device is, in the parameters' stored dtypes.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    cls = _unsharded_class(module)
    if not (hasattr(cls, "from_config") and hasattr(module, "config")):
        raise TypeError(f"an unsharded copy of {cls.__name__} needs a diffusers-style model (from_config + .config); "
                        f"use train.sharding=none for this model")
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    with torch.device("meta"):
        dst = cls.from_config(module.config)
        for name, conf in (getattr(module, "peft_config", None) or {}).items():
            dst.add_adapter(conf, adapter_name=name)
    dst.load_state_dict(state, strict=True, assign=True)
    for name, buf in module.named_buffers():  # non-persistent buffers are not in the state dict
        owner, _, leaf = name.rpartition(".")
        sub = dst.get_submodule(owner) if owner else dst
        if sub._buffers.get(leaf) is None or sub._buffers[leaf].is_meta:
            sub._buffers[leaf] = buf.detach().clone()
    _copy_adapter_switch(module, dst)
    return dst


def _copy_adapter_switch(src: nn.Module, dst: nn.Module) -> None:
    """Disabled peft adapters stay disabled in the copy."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return
    if any(isinstance(m, BaseTunerLayer) and m.disable_adapters for m in src.modules()):
        dst.disable_adapters()
