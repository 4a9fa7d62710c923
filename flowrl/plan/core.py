"""``plan_memory(cfg, gpus, gpu_memory)``: the per-GPU memory plan of a recipe (items, phases, peak, fit).

The meta models and activation fits are cached per model set-up (path, pipeline, LoRA, dtype and
the adapter's geometry: resolution, text length, frames), so re-planning with other knobs
(:mod:`flowrl.plan.knobs`) costs no new measurement unless the model itself changes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..distributed.context import attention_heads
from ..distributed.mesh import ParallelLayout
from ..errors import ConfigError
from .activations import Activations, recipe_geometry
from .budget import Item, model_items, rollout_items, train_items
from .frozen import frozen_items
from .models import meta_components, model_configs, num_params
from .placement import place

GiB = 2 ** 30
_CACHE: dict = {}


def measured_setup(cfg):
    """``(MetaComponents, Activations)`` of ``cfg``'s model set-up (cached)."""
    m, t = cfg.model, cfg.train
    adapter, configs = model_configs(cfg)
    geometry = recipe_geometry(cfg, adapter, configs)
    built = adapter.transformer_component(configs.transformer, m.options)  # e.g. which of Wan2.2's experts train
    key = json.dumps([m.path, m.pipeline, t.lora_rank, t.lora_alpha, t.lora_targets, m.options.get("dtype"),
                      asdict(geometry), built.cls, built.config], sort_keys=True, default=str)
    if key not in _CACHE:
        comp = meta_components(cfg)
        _CACHE[key] = (comp, Activations(comp, geometry))
    return _CACHE[key]


@dataclass
class Plan:
    """Per-GPU bytes by item and phase; ``peak_bytes`` vs ``gpu_memory_bytes`` decides ``fits``."""

    recipe: str
    gpus: int
    gpu_memory_bytes: int
    items: list[Item]
    resident_bytes: int
    rollout_bytes: int  # rollout phase above the resident set
    train_bytes: int  # training phase above the resident set
    step_bytes: int  # optimizer step above the resident set
    peak_bytes: int
    host_bytes: int  # per process, CPU memory (offloaded shards, images, CPU rewards)
    transformer_params: int
    settings: dict = field(default_factory=dict)
    knobs: list = field(default_factory=list)
    unknown: list = field(default_factory=list)  # items whose size is not known (counted as 0)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu_memory_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        d["peak_gib"] = self.peak_bytes / GiB
        return d


def plan_memory(cfg, gpus: int = 1, gpu_memory: int = 80 * GiB, recipe: str = "") -> Plan:
    """The plan of ``cfg`` (a loaded :class:`flowrl.trainers.config.Config`) on ``gpus`` processes of
    ``gpu_memory`` bytes each (module doc of :mod:`flowrl.plan.budget` for the model). With
    ``train.context_parallel: C`` the processes are ``gpus / C`` replicas of ``C``: the transformer's
    activations are one rank's (:meth:`Activations.degree`); ``train.offload`` moves rows to the host
    (:func:`flowrl.plan.placement.place`)."""
    comp, acts = measured_setup(cfg)
    try:  # the trainer's layout of --gpus processes, checked in the same place (the Ulysses degree by the heads)
        layout = ParallelLayout.of(cfg.train, gpus, heads=attention_heads(comp.transformer))
    except ConfigError as e:
        raise ConfigError(f"--gpus {gpus}: {e}") from None
    cp = layout.cp
    acts = acts.degree(cp)
    items = model_items(cfg, comp, gpus) + rollout_items(cfg, comp, acts) + train_items(cfg, comp, acts, gpus)
    items += frozen_items(cfg, acts)  # the update's teachers (Needs.frozen_models)
    items = place(items, cfg.train.offload)
    gpu = [i for i in items if i.where == "gpu"]
    resident = sum(i.bytes for i in gpu if i.group == "resident")
    kept = sum(i.bytes for i in gpu if i.group == "kept")
    gathered = sum(i.bytes for i in gpu if i.group == "gathered")  # FSDP: while the sharded transformer runs
    transient = max((i.bytes + (gathered if i.runs_transformer else 0) for i in gpu if i.group == "transient"),
                    default=0)
    stored = sum(i.bytes for i in gpu if i.group == "kept" and "stored transitions" in i.name)
    train = stored + gathered + sum(i.bytes for i in gpu if i.group == "train")
    rollout = kept + transient
    step = stored + sum(i.bytes for i in gpu if i.group == "step")
    t = cfg.train
    settings = {"sharding": t.sharding, "cpu_offload": t.cpu_offload, "lora_rank": t.lora_rank,
                "minibatch_size": t.minibatch_size, "batch_size": t.batch_size,
                "gradient_checkpointing": bool(cfg.model.options.get("gradient_checkpointing", False)),
                "resolution": [acts.shapes.height, acts.shapes.width], "text_tokens": acts.shapes.text_tokens,
                "model": comp.source, "context_parallel": cp, "data_parallel": gpus // cp,
                "offload": sorted(k for k, v in t.offload.items() if v)}
    return Plan(recipe, gpus, int(gpu_memory), items, resident, rollout, train, step, resident + max(rollout, train, step),
                sum(i.bytes for i in items if i.where == "host"), num_params(comp.transformer, trainable=None)
                - (num_params(comp.transformer, trainable=True) if t.lora_rank > 0 else 0), settings,
                unknown=[i.name for i in items if not i.known])
