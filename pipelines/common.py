"""Pieces the model adapters share."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTypeArg = Union[torch.dtype, str, dict]


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``u + s (c - u)`` (Ho & Salimans 2022), computed in float32."""
    u, c = uncond.float(), cond.float()
    return u + scale * (c - u)


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


def transformer_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """The parameter dtype of ``transformer``, also when a distributed wrapper (DDP, FSDP, DeepSpeed:
    all keep the model in ``.module``) has no ``.dtype`` of its own."""
    return getattr(transformer, "module", transformer).dtype


def check_model_path(path_or_id: str, kind: str) -> None:
    """A local-looking path that does not exist gets an error that says what to do.

    Hub ids (``org/name``) pass through to ``from_pretrained``; offline, that fails in diffusers.
    """
    p = Path(os.path.expanduser(str(path_or_id)))
    looks_local = str(path_or_id).startswith((".", "/", "~")) or p.exists() or str(path_or_id).count("/") != 1
    if looks_local and not p.exists():
        raise FileNotFoundError(
            f"{kind} model path {str(path_or_id)!r} does not exist. Pass a directory written by "
            f"save_pretrained (e.g. `flowrl make-tiny {kind} DIR` for a tiny offline one) or a hub id "
            f"like 'stabilityai/stable-diffusion-3.5-medium'.")


def encode_with_negative(adapter, prompts: list[str], use_negative: bool) -> dict[str, torch.Tensor]:
    """Batch-first ``{"prompt_embeds", "pooled_prompt_embeds"}`` from ``adapter._encode(prompts)``;
    with ``use_negative`` also ``negative_prompt_embeds`` / ``negative_pooled_prompt_embeds``: the
    adapter's ``negative_prompt``, encoded once (cached in ``adapter._negative``) and repeated per row.
    Shared by the SD3 and FLUX adapters (no gradients: the text encoders are frozen)."""
    prompts = list(prompts)
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {i} is {type(p).__name__}, expected str")
    with torch.no_grad():
        pe, pooled = adapter._encode(prompts)
        cond = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
        if use_negative:
            if adapter._negative is None:
                npe, npooled = adapter._encode([adapter.negative_prompt])
                adapter._negative = {"negative_prompt_embeds": npe, "negative_pooled_prompt_embeds": npooled}
            b = len(prompts)
            cond.update({k: v.repeat(b, *([1] * (v.ndim - 1))) for k, v in adapter._negative.items()})
    return cond


def vae_decode(vae, latents: torch.Tensor, device) -> torch.Tensor:
    """Latents ``[B, C, h, w]`` -> float32 images ``[B, 3, 8h, 8w]`` in [0, 1], as the SD3 and FLUX
    pipelines do: ``latents / scaling_factor + shift_factor``, VAE decode, ``x / 2 + 0.5`` clamped."""
    cfg = vae.config
    z = latents.to(device, vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)  # [B, C, h, w]
    with torch.no_grad():
        img = vae.decode(z, return_dict=False)[0]  # [B, 3, H, W] in ~[-1, 1]
    return (img.float() / 2 + 0.5).clamp(0, 1)  # [B, 3, H, W]
