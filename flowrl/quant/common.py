"""What every quantization backend shares: a private merged copy, the skip-list, Linear swapping.

A backend's ``quantize(module, calibrate)`` never touches ``module``: it works on
:func:`merged_copy` (a deep copy with any LoRA merged into its base weights and the
adapter layers removed), so the quantized copy shares nothing mutable with the trained policy.
"""
from __future__ import annotations

import copy
import fnmatch
from typing import Callable, Iterable

import torch
from torch import nn

# Modules kept in full precision, matched (fnmatch) against module names: the embedders and the
# output layers, as modelopt's diffusers example skips them for FLUX / SD3
# (``filter_func_default``), plus the top-level ``proj_out`` that maps back to latents, and Wan's
# ``condition_embedder`` (time, time projection and text embedders; modelopt's
# ``filter_func_wan_video``), whose forward reads the dtype of the time embedder's first parameter;
# FLUX.2's ``time_guidance_embed``; Z-Image's time and caption embedders (``t_embedder``, whose forward
# reads its first layer's weight dtype, and ``cap_embedder``: the patterns diffusers' own
# ``_skip_layerwise_casting_patterns`` keeps precise) and its per-patch input / output layers.
# Wan2.2's two experts (``flowrl.pipelines.experts.TwoExperts``) hold that top level one level down.
DEFAULT_SKIP: tuple[str, ...] = (
    "*time_emb_proj*", "*time_embedding*", "*conv_in*", "*conv_out*", "*conv_shortcut*", "*add_embedding*",
    "*pos_embed*", "*time_text_embed*", "*context_embedder*", "*norm_out*", "*x_embedder*", "proj_out",
    "*condition_embedder*", "*time_guidance_embed*", "*t_embedder*", "*cap_embedder*", "*all_final_layer*",
    "transformer.proj_out", "transformer_2.proj_out",
)


class BackendUnavailable(ValueError):
    """A quantization backend cannot run on this machine; the message names the ones that can."""


def unwrap_model(module: nn.Module) -> nn.Module:
    """The bare module inside (Distributed)DataParallel and ``torch.compile`` (``_orig_mod``) wrappers.

    FSDP2-sharded modules are not unwrapped (a copy of a shard is not the model): :func:`merged_copy`
    gathers them whole (``flowrl.utils.sharded.unsharded_copy``).
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(module, (DataParallel, DistributedDataParallel)):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = module._orig_mod
        else:
            return module


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


@torch.no_grad()
def merged_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` in eval mode, gradients off, with active LoRA adapters merged.

    peft adapter layers (``BaseTunerLayer``) are merged into their base layer's weights
    (``W + scaling * B @ A``) and replaced by that base layer; disabled adapters are dropped
    unmerged. The copy shares no tensor with ``module``.
    """
    from ..utils.sharded import is_sharded, unsharded_copy

    src = unwrap_model(module)
    dst = unsharded_copy(src) if is_sharded(src) else copy.deepcopy(src)  # sharded: gathered (collective)
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: nothing can carry an adapter
        BaseTunerLayer = ()  # type: ignore[assignment]
    tuners = [(n, m) for n, m in dst.named_modules() if BaseTunerLayer and isinstance(m, BaseTunerLayer)]
    for name, layer in sorted(tuners, key=lambda t: -t[0].count(".")):
        if not layer.disable_adapters and layer.active_adapters:
            layer.merge(safe_merge=False)
        _set_submodule(dst, name, layer.get_base_layer())
    if tuners and hasattr(dst, "_hf_peft_config_loaded"):
        dst._hf_peft_config_loaded = False
    return dst.eval().requires_grad_(False)


def is_skipped(name: str, skip: Iterable[str]) -> bool:
    """Whether module ``name`` matches one of the fnmatch patterns in ``skip``."""
    return any(fnmatch.fnmatchcase(name, p) for p in skip)


def replace_linears(root: nn.Module, make: Callable[[str, nn.Linear], nn.Module],
                    skip: Iterable[str] = DEFAULT_SKIP) -> list[str]:
    """Replace every ``nn.Linear`` of ``root`` not matched by ``skip`` with ``make(name, linear)``.

    Returns the replaced module names (empty: nothing to quantize, which callers report).
    """
    skip = tuple(skip)
    names = [n for n, m in root.named_modules() if isinstance(m, nn.Linear) and not is_skipped(n, skip)]
    for n in names:
        _set_submodule(root, n, make(n, root.get_submodule(n)))
    return names


def module_bytes(module: nn.Module) -> int:
    """Bytes held by the parameters and buffers of ``module`` (packed int8 weights included via
    ``extra_bytes()`` of modules that define it)."""
    total = sum(t.numel() * t.element_size() for t in module.parameters())
    total += sum(t.numel() * t.element_size() for t in module.buffers())
    total += sum(int(m.extra_bytes()) for m in module.modules() if hasattr(m, "extra_bytes"))
    return total
