"""``train.sharding=fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) applied by flowrl itself.

flowrl shards the transformer in its own code rather than through accelerate's FSDP plugin, so the
same path runs under two CPU processes (gloo; accelerate drops its FSDP plugin when ``cpu=True``)
and on GPUs (NCCL). Every transformer block the diffusers model lists in ``_no_split_modules`` becomes
one FSDP unit (its parameters all-gathered for its forward and backward, its gradients
reduce-scattered), then the root module takes the rest (embedders, output layers). Each process
keeps 1/N of every parameter, gradient and AdamW state; the EMA, DiffusionNFT's old policy and a
full fine-tune's frozen reference are shards too (nothing holds a second whole model).

Collectives follow the forward passes: every process must run the same number of transformer
forwards in the same order, which flowrl's samplers do (their step counts come from the config) and
its updates do (passes are cut to the minimum over processes). Evaluation therefore runs on every
process under sharding (only the main process writes).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError


def ensure_process_group(device: torch.device) -> None:
    """A one-process group when the run has none (a single process), so ``fully_shard`` has a mesh:
    one process then runs the same sharded code (and the same checkpoint format) as many."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost submodules whose class the model lists in ``_no_split_modules`` (its transformer
    blocks), in order; empty when it lists none (the root unit then holds everything)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if m is model or id(m) in inside:
            continue
        if type(m).__name__ in names:
            found.append(m)
            inside.update(id(s) for s in m.modules())
    return found


def _check_uniform_dtypes(model: nn.Module, units: list[nn.Module], param_dtype: Optional[torch.dtype]) -> None:
    """Each FSDP unit (a block; the root: the parameters outside every block) must hold one dtype."""
    if param_dtype is not None:
        return  # FSDP casts every parameter to param_dtype for compute
    in_blocks = {id(p) for u in units for p in u.parameters()}
    groups = [(u, {p.dtype for p in u.parameters()}) for u in units]
    groups.append((model, {p.dtype for p in model.parameters() if id(p) not in in_blocks}))
    for u, own in groups:
        if len(own) > 1:
            raise ConfigError(f"train.sharding=fsdp: {type(u).__name__} holds parameters of dtypes "
                              f"{sorted(map(str, own))} (e.g. a bf16 base model with fp32 LoRA weights), which FSDP2 "
                              f"cannot all-gather together. Set train.mixed_precision=bf16 (parameters are cast to "
                              f"bf16 for compute, gradients reduced in fp32) or load the model in one dtype.")


def shard_model(model: nn.Module, device: torch.device, *, mixed_precision: str = "no", cpu_offload: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """Apply FSDP2 in place: each block (:func:`block_modules`) is a unit, then the root. On CUDA with
    ``mixed_precision='bf16'`` the unit all-gathers bf16 parameters and reduce-scatters fp32 gradients;
    ``cpu_offload`` keeps the shards (and their gradients and optimizer states) in host memory.
    Returns ``model`` (the same object; its class becomes FSDP2's ``FSDP<Class>``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mixed_precision == "fp16":
        raise ConfigError("train.sharding=fsdp supports train.mixed_precision 'no' or 'bf16' (fp16 would need a "
                          "sharded GradScaler); use bf16")
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    param_dtype = torch.bfloat16 if mixed_precision == "bf16" else None
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    units = block_modules(model)
    _check_uniform_dtypes(model, units, param_dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    return model


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the sharded gradients to total L2 norm ``max_norm``; returns that norm before clipping
    (a plain 0-dim float32 tensor, the same on every process)."""
    from ..utils.sharded import full_tensor

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return full_tensor(norm).float()


def check_launcher(distributed_type, sharding: str) -> None:
    """flowrl shards the model itself (``train.sharding``); accelerate's own FSDP or DeepSpeed wrapping
    of the model is refused with the way to get it."""
    kind = getattr(distributed_type, "value", str(distributed_type))
    if kind == "DEEPSPEED":
        raise ConfigError("flowrl does not run under DeepSpeed (its engine takes over the optimizer step and "
                          "checkpoints). For ZeRO-style sharding launch with configs/accelerate/fsdp.yaml (or any "
                          "multi-GPU config) and set train.sharding=fsdp; see docs/cluster.md")
    if kind == "FSDP" and sharding != "fsdp":
        raise ConfigError("this accelerate config asks for FSDP, but flowrl shards the model itself: set "
                          "train.sharding=fsdp (and launch with configs/accelerate/fsdp.yaml); see docs/cluster.md")
