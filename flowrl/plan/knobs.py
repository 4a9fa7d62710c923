"""Which settings would make a plan fit: each knob re-plans the recipe with a few overrides.

Knobs in order of cost (speed first, then algorithm and hardware changes): gradient checkpointing,
smaller training passes, smaller sampling chunks, cached text embeddings, fewer samples per
process, FSDP sharding, CPU offload, LoRA instead of a full fine-tune. Each knob reports the peak
it gives alone and the bytes it saves; the cumulative set (knobs applied in order until the plan
fits) is reported too.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..trainers.config import load_config, samples_per_prompt
from ..errors import ConfigError
from .core import Plan, plan_memory


def _ckpt(cfg, gpus) -> Optional[list[str]]:
    from ..pipelines import policy_class

    if "gradient_checkpointing" not in policy_class(cfg.model.pipeline).declared_options():  # the adapter's options
        return None
    return None if cfg.model.options.get("gradient_checkpointing") else ["model.options.gradient_checkpointing=true"]


def _minibatch(cfg, gpus) -> Optional[list[str]]:
    m = cfg.train.minibatch_size
    if m <= 1:
        return None
    half = m // 2
    accum = cfg.train.grad_accum * m // half
    return [f"train.minibatch_size={half}", f"train.grad_accum={accum}"]


def _max_batch(cfg, gpus) -> Optional[list[str]]:
    key, current = cfg.sampler.build().forward_rows_option(cfg.train.batch_size)  # the sampler's declaration
    return None if current <= 1 else [f"sampler.{key}={max(1, current // 2)}"]


def _text_cache(cfg, gpus) -> Optional[list[str]]:
    if cfg.model.drop_text_encoders:
        return None
    cache = cfg.model.text_embedding_cache or "cache/text_embeddings"
    return [f"model.text_embedding_cache={cache}", "model.drop_text_encoders=true"]


def _batch(cfg, gpus) -> Optional[list[str]]:
    spp = samples_per_prompt(cfg.sampler.build())
    groups = cfg.train.batch_size // spp
    return None if groups <= 1 else [f"train.batch_size={(groups // 2) * spp}"]


def _fsdp(cfg, gpus) -> Optional[list[str]]:
    return None if cfg.train.sharding == "fsdp" or gpus < 2 else ["train.sharding=fsdp"]


def _offload(cfg, gpus) -> Optional[list[str]]:
    return None if cfg.train.cpu_offload else ["train.sharding=fsdp", "train.cpu_offload=true"]


def _lora(cfg, gpus) -> Optional[list[str]]:
    return None if cfg.train.lora_rank > 0 else ["train.lora_rank=64", "train.lora_alpha=128"]


KNOBS: list[tuple[str, Callable]] = [
    ("gradient checkpointing (~30% slower updates)", _ckpt),
    ("half the training minibatch, twice the accumulation (same optimizer step)", _minibatch),
    ("half the rows per sampling forward (slower rollouts)", _max_batch),
    ("cache text embeddings on disk and drop the text encoders", _text_cache),
    ("half the samples per process (more processes for the same batch)", _batch),
    ("FSDP: shard weights, gradients and optimizer states over the processes", _fsdp),
    ("FSDP CPU offload of the shards (slow)", _offload),
    ("LoRA instead of a full fine-tune", _lora),
]


def _try(recipe, overrides: list[str], gpus: int, gpu_memory: int) -> Optional[Plan]:
    try:
        return plan_memory(load_config(recipe, overrides), gpus, gpu_memory, str(recipe))
    except (ConfigError, ValueError):
        return None


def suggest(recipe, overrides: list[str], base: Plan) -> tuple[list[dict], Optional[dict]]:
    """(each applicable knob with its overrides, peak alone and bytes saved; the cumulative set that fits, or None)."""
    cfg = load_config(recipe, overrides)
    singles, chosen, current = [], list(overrides), cfg
    fit = None
    for label, make in KNOBS:
        extra = make(cfg, base.gpus)
        if extra:
            alone = _try(recipe, list(overrides) + extra, base.gpus, base.gpu_memory_bytes)
            if alone is not None and alone.peak_bytes < base.peak_bytes:
                singles.append({"knob": label, "overrides": extra, "peak_bytes": alone.peak_bytes,
                                "saves_bytes": base.peak_bytes - alone.peak_bytes, "fits": alone.fits})
        step = make(current, base.gpus) if fit is None else None
        if step:
            p = _try(recipe, chosen + step, base.gpus, base.gpu_memory_bytes)
            if p is not None and p.peak_bytes < base.peak_bytes:
                chosen += step
                current = load_config(recipe, chosen)
                if p.fits:
                    fit = {"overrides": chosen[len(overrides):], "peak_bytes": p.peak_bytes}
    return singles, fit
