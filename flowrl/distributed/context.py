"""Context parallelism (``train.context_parallel: C``): every transformer forward split over the tokens
of ``C`` processes, in training (through the backward pass) and in sampling.

diffusers (0.42) declares on each transformer that supports it a ``_cp_plan`` (FLUX, FLUX.2,
Qwen-Image, Wan, LTX, ...): which inputs are split along the sequence before which module, which
output is gathered after which; its attention processors then run Ulysses (an all-to-all from
sequence-split to head-split around attention) or ring attention (key/value chunks passed around the
group, outputs merged by their log-sum-exp) over a device mesh. flowrl uses that plan and those
attention functions as they are, for any transformer that has a plan, and replaces three pieces:

* **set-up**: ``ModelMixin.enable_parallelism`` builds its mesh from the device count, which is 0
  on a CPU (``rank % torch.accelerator.device_count()``); :func:`enable_context_parallel` builds the
  ``(dp, ring, ulysses)`` mesh itself (:func:`flowrl.distributed.mesh.device_mesh`) and gives the same
  ``ParallelConfig`` to the model and its attention processors;
* **the output gather's backward**: diffusers' returns each rank its own slice of the gradient, so
  the parameter gradients of a group's ranks *add up* to the gradient of the loss, while DDP and FSDP
  *average* gradients over all processes: the update would be ``C`` times too small. flowrl's gather
  (:class:`GatherTokens`) has the true adjoint of an all-gather (the gradient summed over the group,
  then sliced), so every rank's loss counts as a data-parallel replica's and the average over the
  ``C x D`` processes is the mean over the ``D`` replicas, exactly the one-process gradient when
  ``D = 1``;
* **the split**: a sequence that does not divide by ``C`` fails with a message naming the setting
  (diffusers asserts).

Which attention: Ulysses needs the head count divisible by its degree, ring attention does not.
``auto`` (:func:`attention_degrees`) runs Ulysses over ``gcd(heads, C)`` and ring attention over the
rest (diffusers' unified attention when both are > 1). diffusers' ring attention needs an attention
backend that returns the log-sum-exp (flash, cuDNN, sage on CUDA); its native (SDPA) backend, the one
a CPU has, does not, so :mod:`flowrl.distributed.ring` adds a plain-torch pair of forward / backward
ops for ring attention under the native backend. Ulysses runs on every backend diffusers marks
context-parallel (native included, forward and backward). diffusers' "anything" variants (uneven
sequences or heads) have no backward and are not used.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from .mesh import ParallelLayout, device_mesh

_SPLIT = "cp_input---{}"  # diffusers' hook names (hooks/context_parallel.py), so its own removal finds them
_GATHER = "cp_output---{}"


def attention_heads(model: nn.Module) -> int:
    """The transformer's attention heads (``config.num_attention_heads``, else its first attention module's)."""
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is None:
        heads = next((m.heads for m in model.modules() if isinstance(getattr(m, "heads", None), int)), None)
    if heads is None:
        raise ConfigError(f"{type(model).__name__}: cannot tell its attention heads for context parallelism")
    return int(heads)


def cp_plan(model: nn.Module) -> dict:
    """The transformer's diffusers ``_cp_plan``; a ConfigError for a model without one."""
    plan = getattr(type(model), "_cp_plan", None) or getattr(model, "_cp_plan", None)
    if not plan:
        raise ConfigError(f"train.context_parallel > 1: {type(model).__name__} declares no context-parallel plan "
                          f"(diffusers' _cp_plan; FLUX, FLUX.2, Qwen-Image, Wan and LTX have one); set "
                          f"train.context_parallel=1 for this model")
    return plan


class GatherTokens(torch.autograd.Function):
    """All-gather of a group's token slices along ``dim`` whose backward is the true adjoint: the
    incoming gradient summed over the group (all-reduce), then this rank's slice (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, size: int, rank: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.dim, ctx.group, ctx.size, ctx.rank = dim, group, size, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class _Tokens:
    """How a group splits and gathers tokens: for real (collectives over ``group``), or emulated on one
    process (``group`` None: this rank's slice is the first, the gather repeats it; the planner measures
    one rank's memory this way on meta tensors)."""

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.group = size, rank, group

    def split(self, x: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        if x.shape[dim] % self.size:
            raise ConfigError(f"context parallelism splits {where} ({x.shape[dim]} tokens along dim {dim}) into "
                              f"{self.size} equal parts: choose a resolution / frame count whose token count is a "
                              f"multiple of train.context_parallel={self.size}, or another degree")
        return x.chunk(self.size, dim)[self.rank if self.group is not None else 0]

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.group is None:
            return torch.cat([x] * self.size, dim)
        return GatherTokens.apply(x, dim, self.group, self.size, self.rank)


def _hook_classes():
    """diffusers' split / gather hooks with flowrl's token split and gather (module doc)."""
    from diffusers.hooks.context_parallel import ContextParallelGatherHook, ContextParallelSplitHook

    class SplitHook(ContextParallelSplitHook):
        def __init__(self, metadata, tokens: _Tokens, where: str):
            super().__init__(metadata, None)
            self.tokens, self.where = tokens, where

        def _prepare_cp_input(self, x, cp_input):
            if cp_input.expected_dims is not None and x.dim() != cp_input.expected_dims:
                return x  # as diffusers: e.g. Wan's [B] timestep under a plan for per-token [B, S] ones
            return self.tokens.split(x, cp_input.split_dim, self.where)

    class GatherHook(ContextParallelGatherHook):
        def __init__(self, metadata, tokens: _Tokens):
            super().__init__(metadata, None)
            self.tokens = tokens

        def post_forward(self, module, output):
            one = isinstance(output, torch.Tensor)
            outs = [output] if one else list(output)
            if len(outs) != len(self.metadata):
                raise ValueError(f"expected {len(self.metadata)} outputs to gather, got {len(outs)}")
            outs = [o if m is None else self.tokens.gather(o, m.gather_dim) for o, m in zip(outs, self.metadata)]
            return outs[0] if one else tuple(outs)

    return SplitHook, GatherHook


def install_plan(model: nn.Module, tokens: _Tokens) -> None:
    """Register the split / gather hooks of the model's ``_cp_plan`` (diffusers' hook registry)."""
    from diffusers.hooks.context_parallel import ContextParallelOutput, _get_submodule_by_name
    from diffusers.hooks.hooks import HookRegistry

    split_cls, gather_cls = _hook_classes()
    for name, entry in cp_plan(model).items():
        found = _get_submodule_by_name(model, name)
        for m in found if isinstance(found, list) else [found]:
            if isinstance(entry, dict):
                hook, key = split_cls(entry, tokens, f"the inputs of {type(model).__name__}.{name or 'forward'}"), \
                    _SPLIT.format(name)
            else:
                entry = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                hook, key = gather_cls(entry, tokens), _GATHER.format(name)
            HookRegistry.check_if_exists_or_initialize(m).register_hook(hook, key)


def remove_plan(model: nn.Module) -> None:
    """Remove what :func:`install_plan` registered."""
    from diffusers.hooks.context_parallel import _get_submodule_by_name
    from diffusers.hooks.hooks import HookRegistry

    for name, entry in cp_plan(model).items():
        found = _get_submodule_by_name(model, name)
        for m in found if isinstance(found, list) else [found]:
            key = (_SPLIT if isinstance(entry, dict) else _GATHER).format(name)
            HookRegistry.check_if_exists_or_initialize(m).remove_hook(key)


def emulate_context_parallel(model: nn.Module, cp: int) -> None:
    """One rank's view of a ``cp``-way split on a single process, without collectives: inputs sliced,
    outputs repeated, attention local (the same bytes per rank as Ulysses' head-split attention). For
    memory measurement on meta tensors (``flowrl plan``); ``cp == 1`` removes it."""
    if getattr(model, "_flowrl_cp_emulated", 1) > 1:
        remove_plan(model)
    if cp > 1:
        install_plan(model, _Tokens(cp, 0))
    model._flowrl_cp_emulated = cp


def _attention_processors(model: nn.Module) -> list:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m.processor for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))
            and getattr(m, "processor", None) is not None and hasattr(m.processor, "_parallel_config")]


def _check_backend(processors: list, ring: int) -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    if not processors:
        raise ConfigError("context parallelism found no attention processor that takes a parallel config")
    name = processors[0]._attention_backend
    backend = AttentionBackendName(name) if name else _AttentionBackendRegistry.get_active_backend()[0]
    if not _AttentionBackendRegistry._is_context_parallel_available(backend):
        raise ConfigError(f"the attention backend {backend.value!r} does not support context parallelism; use one of "
                          f"{sorted(_AttentionBackendRegistry._supports_context_parallel)}")
    if ring > 1 and backend == AttentionBackendName.NATIVE:
        from .ring import install_native_ring

        install_native_ring()


def enable_context_parallel(model: nn.Module, layout: ParallelLayout, device: torch.device,
                            mesh=None) -> Optional[object]:
    """Split ``model``'s forwards over ``layout``'s context-parallel group (collective: every process
    calls it, in the same order for every model) with the layout's Ulysses and ring degrees (chosen from the
    model's heads and the layout's ``attention`` where the layout has none yet). Returns the device mesh (None when
    ``layout.cp == 1``: nothing is done); pass it back as ``mesh`` for a second model of the same run."""
    if layout.cp == 1:
        return None
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    cp_plan(model)  # (a clear error before any collective)
    if not layout.ulysses:
        layout = layout.with_attention(attention_heads(model))
    ulysses, ring = layout.ulysses, layout.ring
    mesh = mesh if mesh is not None else device_mesh(layout, device, ulysses, ring)
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses,
                                                                          mesh=mesh))
    config.setup(layout.rank, layout.world, device, mesh=mesh)
    processors = _attention_processors(model)
    _check_backend(processors, ring)
    for p in processors:
        p._parallel_config = config
    model._parallel_config = config
    group = config.context_parallel_config._flattened_mesh
    install_plan(model, _Tokens(layout.cp, group.get_local_rank(), group.get_group()))
    return mesh
