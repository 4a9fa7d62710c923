"""What lives in host memory instead of the GPU (``train.offload``), and the code that keeps it there.

``train.offload`` is a mapping of booleans (all false by default):

==================  ======================================================================================
``fsdp``            FSDP2's ``CPUOffloadPolicy`` (``train.sharding=fsdp``): the trained model's shards, their
                    gradients and the AdamW states in host memory, copied to the GPU block by block for each
                    forward and backward, and the optimizer step on the CPU. The same setting as the older
                    ``train.cpu_offload`` (either sets both).
``text_encoders``   the text encoders stay in host memory and move to the GPU for each encoding call, then back.
                    With ``model.text_embedding_cache`` + ``model.drop_text_encoders`` they are not kept at all,
                    and not even loaded once the cache covers every training and evaluation prompt.
``vae``             the VAE stays in host memory and moves to the GPU for each encode / decode call.
``reference``       a full fine-tune's frozen reference copy (an update whose KL needs the reference): its FSDP shards in host
                    memory (``CPUOffloadPolicy`` on the copy), gathered to the GPU block by block for its forward
                    (needs ``train.sharding=fsdp``; a LoRA run's reference is the adapter-disabled model: no copy).
``ema``             the EMA of the trained tensors in host memory (updated from the GPU weights every
                    ``train.ema_every`` steps, copied in for evaluation).
==================  ======================================================================================

Each moves bytes between the GPU and the host on every use; ``flowrl plan`` counts offloaded items as
host memory (docs/memory.md) and ``flowrl plan --suggest`` turns them on only when nothing cheaper fits.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import ConfigError

OFFLOAD_KEYS = ("fsdp", "text_encoders", "vae", "reference", "ema")


@dataclass(frozen=True)
class Offload:
    """``train.offload`` as flags (module doc)."""

    fsdp: bool = False
    text_encoders: bool = False
    vae: bool = False
    reference: bool = False
    ema: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def any(self) -> bool:
        return any(asdict(self).values())


def offload_settings(train) -> Offload:
    """Validate ``train.offload`` against the rest of ``train`` (one-line errors) and merge the older
    ``train.cpu_offload`` into ``fsdp``; sets ``train.cpu_offload`` from it too."""
    given = train.offload if train.offload is not None else {}
    if not isinstance(given, dict):
        raise ConfigError(f"train.offload must be a mapping of {', '.join(OFFLOAD_KEYS)} to true/false, got {given!r}")
    for k, v in given.items():
        if k not in OFFLOAD_KEYS:
            raise ConfigError(f"train.offload.{k}: unknown; valid: {', '.join(OFFLOAD_KEYS)}")
        if not isinstance(v, bool):
            raise ConfigError(f"train.offload.{k} must be true or false, got {v!r}")
    flags = Offload(**{**given, "fsdp": bool(given.get("fsdp")) or bool(train.cpu_offload)})
    train.cpu_offload = flags.fsdp
    if flags.fsdp and train.sharding != "fsdp":
        raise ConfigError("train.offload.fsdp (train.cpu_offload=true) needs train.sharding=fsdp (it offloads the "
                          "FSDP shards)")
    if flags.reference and train.sharding != "fsdp":
        raise ConfigError("train.offload.reference keeps the frozen reference's FSDP shards in host memory: set "
                          "train.sharding=fsdp")
    if flags.reference and train.lora_rank > 0:
        raise ConfigError("train.offload.reference has no effect with LoRA (train.lora_rank > 0): the reference is "
                          "the adapter-disabled model, no copy; drop it")
    if flags.ema and not train.ema:
        raise ConfigError("train.offload.ema has no effect without train.ema=true; drop it or set train.ema=true")
    return flags


def keep_on_host(module: nn.Module, device: torch.device, methods: tuple[str, ...] = ("forward",)) -> nn.Module:
    """``module`` moved to host memory; each of its ``methods`` (instance attributes wrapping the class's)
    moves it to ``device`` for the call and back afterwards (the outermost call only, when one calls
    another). Returns ``module``."""
    module.to("cpu")
    depth = [0]
    for name in methods:
        fn = getattr(module, name)

        @functools.wraps(fn)
        def on_device(*args, __fn=fn, **kwargs):
            if depth[0] == 0:
                module.to(device)
            depth[0] += 1
            try:
                return __fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    module.to("cpu")

        setattr(module, name, on_device)
    return module


def offload_idle(policy, flags: Offload, device: torch.device) -> list[str]:
    """Apply ``text_encoders`` / ``vae`` of ``flags`` to a loaded policy (its ``pipe``'s text encoders, its
    ``vae``); returns the names of the modules kept in host memory."""
    holder = getattr(policy, "pipe", policy)
    kept = []
    if flags.text_encoders:
        for name in getattr(policy, "text_encoder_names", ("text_encoder",)):
            mod = getattr(holder, name, None)
            if isinstance(mod, nn.Module):
                keep_on_host(mod, device)
                kept.append(name)
    vae = getattr(policy, "vae", None)
    if flags.vae and isinstance(vae, nn.Module):
        keep_on_host(vae, device, ("encode", "decode", "forward"))
        kept.append("vae")
    return kept
