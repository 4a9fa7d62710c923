"""``flowrl plan --suggest``: the smallest setting that fits a recipe on GPUs of a given size.

A setting is ``(GPUs, FSDP x CP, offload, activation checkpointing)``: ``G`` processes as ``G / C``
data-parallel replicas of ``C`` context-parallel ranks (the mesh ``G/C x C``), the state DDP-replicated
or FSDP-sharded over all ``G``, what ``train.offload`` keeps in host memory, and
``model.options.gradient_checkpointing``. The recipe's per-replica batch (``train.batch_size``) and
everything else stay as given.

The search walks ``G = 1, 2, 4, ...`` up to ``max_gpus``; at each count it tries the settings in order
of cost (:func:`candidates`: no offload before offloading the frozen parts (text encoders, VAE) before
offloading the trained state; no checkpointing before checkpointing; smaller context-parallel groups
first; DDP before FSDP) and names the first that fits. For the count before it, it reports the lowest
peak any setting reaches and that plan's largest rows: why nothing smaller fits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from ..trainers.config import load_config
from .core import GiB, Plan, plan_memory

LEVELS = ("none", "frozen parts (text encoders, VAE)", "frozen parts + the FSDP-sharded state")


@dataclass
class Setting:
    """One candidate: ``gpus`` processes, ``sharding``, context-parallel degree ``cp``, checkpointing
    ``ckpt``, offload level (index into ``LEVELS``) and the overrides that make it."""

    gpus: int
    sharding: str
    cp: int
    ckpt: bool
    level: int
    overrides: list = field(default_factory=list)

    @property
    def cost(self) -> tuple:
        return self.level, self.ckpt, self.cp, self.sharding == "fsdp"

    def describe(self) -> str:
        state = f"FSDP over all {self.gpus}" if self.sharding == "fsdp" else "DDP replicas"
        return (f"{self.gpus} GPU(s) = {self.gpus // self.cp} data-parallel x {self.cp} context-parallel ({state}), "
                f"gradient checkpointing {'on' if self.ckpt else 'off'}, offload: {LEVELS[self.level]}")


def _offload(cfg, level: int, sharding: str) -> Optional[dict]:
    """The ``train.offload`` mapping of ``level`` for ``cfg`` (None: not applicable)."""
    if level == 0:
        return {}
    out = {"text_encoders": True, "vae": True}
    if level == 2:
        if sharding != "fsdp":
            return None
        out.update(fsdp=True, ema=bool(cfg.train.ema))
        if cfg.train.lora_rank == 0 and cfg.train.update_needs.reference:
            out["reference"] = True
    return out


def _has_cp_plan(cfg) -> bool:
    from .models import model_configs
    from ..pipelines.facts import component_class

    adapter, _ = model_configs(cfg)
    return bool(getattr(component_class("diffusers:" + adapter.transformer_class), "_cp_plan", None))


def candidates(cfg, gpus: int) -> list[Setting]:
    """Every setting on ``gpus`` processes, cheapest first (module doc)."""
    cps = [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= gpus and gpus % c == 0]
    if not _has_cp_plan(cfg):
        cps = [1]
    out = []
    for sharding in ("none", "fsdp"):
        for cp in cps:
            for ckpt in (False, True):
                for level in range(len(LEVELS)):
                    off = _offload(cfg, level, sharding)
                    if off is None or (sharding == "fsdp" and gpus == 1 and level < 2):
                        continue  # FSDP over one process divides nothing: only for its CPU offload
                    ov = [f"train.sharding={sharding}", f"train.context_parallel={cp}",
                          f"model.options.gradient_checkpointing={str(ckpt).lower()}",
                          "train.offload={" + ", ".join(f"{k}: {str(v).lower()}" for k, v in off.items()) + "}",
                          "train.cpu_offload=false"]
                    out.append(Setting(gpus, sharding, cp, ckpt, level, ov))
    return sorted(out, key=lambda s: s.cost)


def _plan(recipe, overrides: list[str], s: Setting, gpu_memory: int) -> Optional[Plan]:
    try:
        return plan_memory(load_config(recipe, list(overrides) + s.overrides), s.gpus, gpu_memory, str(recipe))
    except (ConfigError, ValueError):
        return None  # e.g. a token count that does not divide by the context-parallel degree


def largest_rows(plan: Plan, n: int = 4) -> list[tuple[str, int]]:
    """The ``n`` largest GPU rows of ``plan`` that count toward its peak (name, bytes)."""
    rows = [i for i in plan.items if i.where == "gpu" and i.group != "alternative" and i.bytes > 0]
    return [(i.name, i.bytes) for i in sorted(rows, key=lambda i: -i.bytes)[:n]]


def suggest_setting(recipe, overrides: list[str], gpu_memory: int, max_gpus: int = 64,
                    max_level: int = len(LEVELS) - 1) -> dict:
    """``{"fit": {setting, overrides, peak_bytes, host_bytes, gpus, data_parallel} | None, "smaller": {gpus,
    setting, peak_bytes, rows} | None}``: the cheapest setting on the fewest GPUs that fits (offload up to
    level ``max_level`` of ``LEVELS``), and the best the count before it reaches."""
    base = load_config(recipe, list(overrides))
    gpus, smaller = 1, None
    while gpus <= max_gpus:
        best: Optional[tuple[Setting, Plan]] = None
        for s in candidates(base, gpus):
            p = _plan(recipe, overrides, s, gpu_memory) if s.level <= max_level else None
            if p is None:
                continue
            if p.fits:
                return {"fit": {"setting": s.describe(), "overrides": s.overrides, "peak_bytes": p.peak_bytes,
                                "host_bytes": p.host_bytes, "gpus": gpus, "data_parallel": gpus // s.cp,
                                "level": s.level}, "smaller": smaller}
            if best is None or p.peak_bytes < best[1].peak_bytes:
                best = (s, p)
        if best is not None:
            smaller = {"gpus": gpus, "setting": best[0].describe(), "peak_bytes": best[1].peak_bytes,
                       "rows": largest_rows(best[1])}
        gpus *= 2
    return {"fit": None, "smaller": smaller}


def suggest(recipe, overrides: list[str], gpu_memory: int, max_gpus: int = 64) -> dict:
    """``{"any": ..., "on_gpu": ...}``: :func:`suggest_setting` with every offload, and (when that answer
    offloads the trained state) without offloading the trained state (much faster per step)."""
    out = {"any": suggest_setting(recipe, overrides, gpu_memory, max_gpus)}
    fit = out["any"]["fit"]
    if fit is not None and fit["level"] == len(LEVELS) - 1:
        out["on_gpu"] = suggest_setting(recipe, overrides, gpu_memory, max_gpus, max_level=len(LEVELS) - 2)
    return out


def _answer(title: str, result: dict) -> list[str]:
    fit, smaller = result["fit"], result["smaller"]
    if fit is None:
        lines = [f"  {title}: nothing up to the largest GPU count tried fits"]
    else:
        lines = [f"  {title}: {fit['setting']} -> peak {fit['peak_bytes'] / GiB:.1f} GiB per GPU, "
                 f"{fit['host_bytes'] / GiB:.1f} GiB of host memory per process",
                 f"    overrides: {' '.join(fit['overrides'])}",
                 f"    ({fit['data_parallel']} data-parallel replica(s) of train.batch_size samples each)"]
    if smaller is not None:
        lines.append(f"    {smaller['gpus']} GPU(s) do not fit: the lowest peak there ({smaller['setting']}) is "
                     f"{smaller['peak_bytes'] / GiB:.1f} GiB; its largest rows: "
                     + ", ".join(f"{name} {b / GiB:.1f}" for name, b in smaller["rows"]))
    return lines


def format_suggestion(result: dict, recipe, gpu_memory: int) -> str:
    """The ``--suggest`` answer (:func:`suggest`) as text."""
    lines = ["", f"flowrl plan --suggest: the smallest setting for {recipe} on GPUs of {gpu_memory / GiB:.1f} GiB"]
    lines += _answer("smallest", result["any"])
    if "on_gpu" in result:
        lines += _answer("smallest with the trained state on the GPUs (no FSDP CPU offload: faster steps)",
                         result["on_gpu"])
    return "\n".join(lines)
