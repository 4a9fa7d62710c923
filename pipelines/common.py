"""Model-independent pieces the adapters share: classifier-free guidance, dtypes, paths, VAE decoding.

The diffusers adapter base (``from_pretrained``, negative-prompt cache, resolutions, export and
tiny-model declarations) is ``pipelines/base.py``.
"""
from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, Sequence, Union

import torch

from flowrl.options import AtLeast, OneOf
from flowrl.schedules import SCHEDULE_KINDS, flow_sigmas

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

# The option types the adapters share (their declarations: flowrl.options; checked before a model loads)
DTypeName = Annotated[str, OneOf(tuple(DTYPES))]
DTypeArg = Union[torch.dtype, DTypeName, dict[str, DTypeName]]  # one dtype, or diffusers' per-component dict
Pixels = Annotated[int, AtLeast(1)]
Resolution = Union[Pixels, tuple[Pixels, Pixels], None]  # an image side, or (height, width); None: the model's
Shift = Optional[Annotated[float, AtLeast(0, strict=True)]]  # a static timestep shift; None: the scheduler's own
Schedule = Literal[SCHEDULE_KINDS]  # flowrl.schedules.flow_sigmas' kinds (with a shift)
TextTokens = Annotated[int, AtLeast(1)]


def resolve_resolution(resolution: Resolution, default: int, multiple: int) -> tuple[int, int]:
    """``(H, W)`` in pixels from an int, a pair or None (-> ``default``), checked against ``multiple``."""
    if resolution is None:
        resolution = default
    hw = (resolution, resolution) if isinstance(resolution, int) else tuple(int(r) for r in resolution)
    if len(hw) != 2:
        raise ValueError(f"resolution must be an int or an (H, W) pair, got {resolution!r}")
    h, w = hw
    if h <= 0 or w <= 0 or h % multiple or w % multiple:
        raise ValueError(f"resolution must be positive multiples of {multiple} pixels (VAE factor x patch size), "
                         f"got {(h, w)}")
    return h, w


# FlowMatchEulerDiscreteScheduler options the adapters' reproductions of their pipelines' schedules do not cover
SCHEDULER_OPTIONS_NOT_REPRODUCED = ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                                    "invert_sigmas", "use_flow_sigmas")


def check_scheduler(owner: str, config, shift: Optional[float], schedule: str, *, dynamic: bool = False) -> None:
    """Refuse a scheduler ``config`` whose options (:data:`SCHEDULER_OPTIONS_NOT_REPRODUCED`, a time shift
    other than the exponential one; with ``dynamic``, a static scheduler) ``owner``'s reproduction of the
    pipeline's schedule does not cover, unless ``shift`` replaces that schedule by flowrl's static-shift one
    (``flow_sigmas(T, shift, schedule)``, whose arguments are validated here)."""
    unsupported = [k for k in SCHEDULER_OPTIONS_NOT_REPRODUCED if config.get(k)]
    if config.get("use_dynamic_shifting") and config.get("time_shift_type", "exponential") != "exponential":
        unsupported.append("time_shift_type=" + str(config.get("time_shift_type")))
    if dynamic and not config.get("use_dynamic_shifting"):
        unsupported.append("use_dynamic_shifting=False")
    if unsupported and shift is None:
        raise ValueError(f"{owner} cannot reproduce a scheduler with {unsupported}; pass shift= to use flowrl's "
                         f"static-shift schedule instead")
    if shift is not None:
        flow_sigmas(1, float(shift), schedule)  # validate early


def scheduler_sigmas(scheduler, sigmas, mu: Optional[float] = None) -> torch.Tensor:
    """``[T + 1]`` float32 on the CPU: the sigmas a fresh copy of the pipeline's ``scheduler`` (a diffusers
    flow-matching scheduler; the pipeline's own stays untouched) makes of the ``T`` ``sigmas`` a pipeline gives
    it, with the time shift at ``mu`` when it shifts dynamically (ignored by a static one); the last is 0."""
    fresh = type(scheduler).from_config(scheduler.config)
    fresh.set_timesteps(sigmas=sigmas, mu=mu)
    return fresh.sigmas.to("cpu", torch.float32)  # [T + 1]


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float, *, uncond_grad: bool) -> torch.Tensor:
    """Classifier-free guidance ``u + s (c - u)`` (Ho & Salimans 2022), computed in float32.

    ``uncond_grad=False`` detaches ``u`` (Flow-GRPO's training forward), so only the conditional half
    carries the gradient; adapters pass their ``cfg_uncond_grad`` attribute (the trainer sets it from
    ``train.loss_options.cfg_uncond_grad``). Values are the same either way.
    """
    u, c = uncond.float(), cond.float()
    if not uncond_grad:
        u = u.detach()
    return u + scale * (c - u)


def cfg_halves(forward: Callable[..., torch.Tensor], uncond: Sequence[torch.Tensor],
               cond: Sequence[torch.Tensor], *, uncond_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The unconditional and conditional outputs ``(u, c)`` [B, ...] each of ``forward(*args)`` for
    classifier-free guidance; ``uncond`` / ``cond`` are its batch-first arguments per half. The caller
    combines them with :func:`cfg_combine` (same ``uncond_grad``).

    Sampling (gradients off), and training with ``uncond_grad=True``: one doubled batch
    ``forward(cat(uncond_i, cond_i) ...)`` split in halves, as the diffusers pipelines do. A
    differentiable forward with ``uncond_grad=False``: the unconditional half runs alone under
    ``no_grad`` and only the conditional half enters the autograd graph (half the saved activations
    and backward work). Values agree with the doubled batch up to batch-composition float rounding;
    the gradient is the same as the doubled batch's with ``u`` detached.
    """
    if torch.is_grad_enabled() and not uncond_grad:
        with torch.no_grad():
            u = forward(*uncond)  # [B, ...], no graph
        return u, forward(*cond)
    out = forward(*(torch.cat([a, b]) for a, b in zip(uncond, cond)))  # [2B, ...]
    u, c = out.chunk(2)  # [B, ...] each
    return u, c


def resolve_dtype(dtype: DTypeArg) -> Union[torch.dtype, dict]:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"bf16"``, ...), or a diffusers
    per-component dict (``{"default": "bfloat16", "vae": "float32"}``) with its values resolved.

    YAML recipes cannot hold ``torch.bfloat16``; diffusers silently falls back to float32 for a
    dtype given as a string, so names are resolved here, and unknown ones are an error.
    """
    if isinstance(dtype, dict):
        return {str(k): resolve_dtype(v) for k, v in dtype.items()}
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be a torch.dtype, one of {sorted(DTYPES)}, or a per-component dict of those "
                     f"(e.g. {{default: bfloat16, vae: float32}}), got {dtype!r}")


# module -> (dtype, weakref to the probe parameter's owner, its name, weakref to the parameter)
_DTYPE_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _dtype_probe(module: torch.nn.Module, dtype: torch.dtype) -> Optional[tuple]:
    """``(owner, name, parameter)`` of the parameter diffusers' ``.dtype`` reads (the first floating
    one outside ``_keep_in_fp32_modules``), if it has ``dtype``; None when the dtype came from
    elsewhere (a layerwise-casting hook, a buffer): such modules are not cached."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    for mod_name, mod in module.named_modules():
        for name, p in mod._parameters.items():
            if p is None or any(k in f"{mod_name}.{name}".lstrip(".") for k in keep) or not p.is_floating_point():
                continue
            return (mod, name, p) if p.dtype == dtype else None
    return None


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """``module.dtype`` (diffusers' parameter dtype) in O(1) after the first call.

    diffusers' ``ModelMixin.dtype`` walks every submodule (looking for casting hooks) on each read:
    ~1 ms on the tiny SD3, ~14 ms on an SD3.5-Medium-shaped model with LoRA, per ``velocity`` call.
    The answer is cached per module with the parameter it was read from; a cached entry is used
    while that parameter is still registered under its name and still has the cached dtype, so
    ``.to(dtype)`` / ``.half()`` (in place, or replacing the parameters) and ``.to(device)`` are
    seen. Not seen: a layerwise-casting hook enabled later whose storage dtype equals the current
    one (call :func:`forget_module_dtype` after such surgery).
    """
    hit = _DTYPE_CACHE.get(module)
    if hit is not None:
        dtype, owner_ref, name, param_ref = hit
        owner, param = owner_ref(), param_ref()
        if owner is not None and param is not None and owner._parameters.get(name) is param and param.dtype == dtype:
            return dtype
    dtype = getattr(module, "dtype", None)  # diffusers: the full walk
    if not isinstance(dtype, torch.dtype):  # a plain nn.Module: its first floating parameter's
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    probe = _dtype_probe(module, dtype)
    if probe is None:
        _DTYPE_CACHE.pop(module, None)
    else:
        owner, name, param = probe
        _DTYPE_CACHE[module] = (dtype, weakref.ref(owner), name, weakref.ref(param))
    return dtype


def forget_module_dtype(module: torch.nn.Module) -> None:
    """Drop ``module``'s cached dtype (:func:`module_dtype`); the next read walks it again."""
    _DTYPE_CACHE.pop(getattr(module, "module", module), None)


def transformer_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The parameter dtype of ``transformer`` (:func:`module_dtype`, O(1) after the first read), also
    when a distributed wrapper (DDP, FSDP, DeepSpeed: all keep the model in ``.module``) has no
    ``.dtype`` of its own."""
    return module_dtype(getattr(transformer, "module", transformer))


def check_model_path(path_or_id: str, kind: str, example_hub_id: Optional[str] = None,
                     cache_dir: Optional[str] = None) -> None:
    """A local-looking path that does not exist gets an error that says what to do.

    Hub ids (``org/name``) pass through to ``from_pretrained`` when they are in the local cache or can
    be downloaded; otherwise they fail here at once (:func:`flowrl.utils.hub.require_hub_model`).
    """
    p = Path(os.path.expanduser(str(path_or_id)))
    looks_local = str(path_or_id).startswith((".", "/", "~")) or p.exists() or str(path_or_id).count("/") != 1
    if looks_local and not p.exists():
        raise FileNotFoundError(
            f"{kind} model path {str(path_or_id)!r} does not exist. Pass a directory written by "
            f"save_pretrained (e.g. `flowrl make-tiny {kind} DIR` for a tiny offline one) or a hub id "
            f"like {example_hub_id or 'stabilityai/stable-diffusion-3.5-medium'!r}.")
    from flowrl.utils.hub import require_hub_model

    require_hub_model(path_or_id, f"the {kind} base model", "model.path", cache_dir)


DECODE_BATCH = 8  # images per VAE call: at 512 px a float32 SD3 / FLUX decode holds ~0.75 GiB per image


def vae_decode(vae, latents: torch.Tensor, device, batch: Optional[int] = DECODE_BATCH) -> torch.Tensor:
    """Latents ``[B, C, h, w]`` -> float32 images ``[B, 3, f h, f w]`` in [0, 1] (f = the VAE's factor),
    as the diffusers pipelines do: ``latents / scaling_factor + shift_factor`` (0 when the
    VAE has none, e.g. SANA's DC-AE), VAE decode, ``x / 2 + 0.5`` clamped. The VAE runs on ``batch``
    images at a time (None: all at once), so its activations do not grow with the rollout."""
    cfg = vae.config
    shift = getattr(cfg, "shift_factor", None) or 0.0
    step = batch or max(1, len(latents))
    out = []
    for i in range(0, len(latents), step):
        z = latents[i:i + step].to(device, module_dtype(vae)) / cfg.scaling_factor + shift  # [b, C, h, w]
        with torch.no_grad():
            img = vae.decode(z, return_dict=False)[0]  # [b, 3, H, W] in ~[-1, 1]
        out.append((img.float() / 2 + 0.5).clamp(0, 1))  # [b, 3, H, W]
    return torch.cat(out)  # [B, 3, H, W]


def vae_encode(vae, images: torch.Tensor, device, batch: Optional[int] = DECODE_BATCH) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1] -> float32 latents ``[B, C, h, w]``, the inverse of :func:`vae_decode`: VAE
    encode of ``2 x - 1`` (the latent distribution's mode; a deterministic encoder's output, e.g. SANA's DC-AE),
    then ``(z - shift_factor) * scaling_factor``; ``batch`` images per VAE call."""
    cfg = vae.config
    shift = getattr(cfg, "shift_factor", None) or 0.0
    step = batch or max(1, len(images))
    out = []
    for i in range(0, len(images), step):
        x = images[i:i + step].to(device, module_dtype(vae)) * 2 - 1  # [b, 3, H, W] in [-1, 1]
        with torch.no_grad():
            enc = vae.encode(x)
        z = enc.latent_dist.mode() if hasattr(enc, "latent_dist") else enc.latent  # [b, C, h, w]
        out.append((z.float() - shift) * cfg.scaling_factor)
    return torch.cat(out)  # [B, C, h, w]

