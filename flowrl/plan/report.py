"""The plan as a table (GiB per GPU), its JSON form, the ``--measure`` check as a table, ``--gpu-memory``
parsing, and docs/memory.md's table of the shipped recipes (``python -m flowrl.plan.report RECIPES``)."""
from __future__ import annotations

import re
from pathlib import Path

from .core import GiB, Plan

_UNITS = {"": GiB, "gib": GiB, "gb": 10 ** 9, "mib": 2 ** 20, "mb": 10 ** 6, "tib": 2 ** 40, "tb": 10 ** 12}
GROUP_TITLES = {"resident": "resident (whole run)", "gathered": "FSDP: gathered during transformer passes",
                "kept": "rollout: kept", "transient": "rollout: transients (largest counts)",
                "train": "training pass", "step": "optimizer step", "alternative": "not used by this recipe"}


def parse_memory(text: str) -> int:
    """Bytes of ``"80GiB"``, ``"80GB"`` (10^9), ``"141GiB"``, ``"512MiB"`` or a plain number (GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--gpu-memory {text!r}: give a positive size such as 80GiB, 80GB, 141GiB or 80 (GiB); "
                         f"units: {', '.join(u for u in _UNITS if u)}")
    return int(float(m.group(1)) * _UNITS[unit])


def _gib(b: float) -> str:
    return f"{b / GiB:8.2f}"


def format_plan(plan: Plan) -> str:
    """A text table: one row per item (GiB per GPU; host rows per process), the phases, the peak, the fit."""
    width = max(len(i.name) for i in plan.items) + 2
    s = plan.settings
    lines = [f"flowrl plan: {plan.recipe or 'recipe'} on {plan.gpus} GPU(s) of {plan.gpu_memory_bytes / GiB:.1f} GiB",
             f"  model {s['model']} ({plan.transformer_params / 1e9:.2f}B transformer params), "
             f"{s['resolution'][0]}x{s['resolution'][1]} px, {s['text_tokens']} text tokens, "
             f"sharding={s['sharding']}{' + cpu_offload' if s['cpu_offload'] else ''}, "
             f"lora_rank={s['lora_rank']}, gradient_checkpointing={str(s['gradient_checkpointing']).lower()}",
             f"  mesh: {s['data_parallel']} data-parallel x {s['context_parallel']} context-parallel "
             f"process(es); offload: {', '.join(s['offload']) or 'none'}",
             f"  {'item':<{width}}{'GiB':>8}  note"]
    for group, title in GROUP_TITLES.items():
        rows = [i for i in plan.items if i.group == group]
        if rows:
            lines.append(f"  -- {title}")
        for i in rows:
            where = " [host]" if i.where == "host" else ""
            size = _gib(i.bytes) if i.known else f"{'?':>8}"
            lines.append(f"  {i.name:<{width}}{size}  {i.note}{where}")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines += [f"  {'resident':<{width}}{_gib(plan.resident_bytes)}",
              f"  {'+ rollout phase (kept + largest transient)':<{width}}{_gib(plan.rollout_bytes)}",
              f"  {'+ training phase (stored transitions + activations)':<{width}}{_gib(plan.train_bytes)}",
              f"  {'+ optimizer step (stored transitions + step temporaries)':<{width}}{_gib(plan.step_bytes)}",
              f"  {'peak per GPU = resident + max(phases)':<{width}}{_gib(plan.peak_bytes)}  {verdict} in "
              f"{plan.gpu_memory_bytes / GiB:.1f} GiB",
              f"  {'host memory per process':<{width}}{_gib(plan.host_bytes)}"]
    if plan.unknown:
        lines.append(f"  not counted (size unknown): {', '.join(plan.unknown)}")
    lines += format_knobs(plan)
    return "\n".join(lines)


def format_knobs(plan: Plan) -> list[str]:
    if plan.fits or not plan.knobs:
        return []
    singles, fit = plan.knobs
    out = ["", "knobs that lower the peak (each alone, in order of cost):"]
    for k in singles:
        out.append(f"  {k['knob']}: {' '.join(k['overrides'])}  -> {k['peak_bytes'] / GiB:.1f} GiB "
                   f"(saves {k['saves_bytes'] / GiB:.1f} GiB){'  fits' if k['fits'] else ''}")
    if fit:
        out.append(f"together, in that order, these fit ({fit['peak_bytes'] / GiB:.1f} GiB): {' '.join(fit['overrides'])}")
    else:
        out.append("no combination of these knobs fits: use GPUs with more memory")
    return out


def plan_json(plan: Plan) -> dict:
    d = plan.to_dict()
    if plan.knobs:
        d["knobs"] = {"each": plan.knobs[0], "together": plan.knobs[1]}
    return d


MEASURED_PASSES = {"train": "training step (forward + backward + AdamW)", "infer": "sampling forward (no grad)"}


def format_measure(m: dict) -> str:
    """``flowrl plan --measure``'s result (:func:`flowrl.plan.measure.measure_recipe`) as a table (MiB)."""
    how = "torch.cuda.max_memory_allocated" if m["device"].startswith("cuda") else "torch profiler, allocator peak"
    width = max(map(len, MEASURED_PASSES.values())) + 2
    weights = {"random": "; random weights of the recipe's config"}.get(m.get("weights", ""), "")
    lines = ["", f"measured peak vs plan on {m['device']} ({how}{weights}; error = (planned - measured) / measured):",
             f"  {'pass':<{width}}{'rows':>6}{'measured MiB':>15}{'planned MiB':>14}{'error':>9}"]
    for k, title in MEASURED_PASSES.items():
        r = m[k]
        lines.append(f"  {title:<{width}}{m['rows'][k]:>6}{r['measured_bytes'] / 2**20:>15.1f}"
                     f"{r['planned_bytes'] / 2**20:>14.1f}{100 * r['relative_error']:>+8.1f}%")
    if m.get("per_rank"):  # a context-parallel measurement: the smallest of the ranks' upper bounds is shown
        each = "; ".join(f"{MEASURED_PASSES[k]} " + " / ".join(f"{b / 2**20:.1f}" for b in v)
                         for k, v in m["per_rank"].items())
        lines.append(f"  (the smallest of {m['ranks']} ranks' readings, each an upper bound of the same peak; "
                     f"per rank, MiB: {each})")
    return "\n".join(lines)


VARIANTS = (("LoRA", "none", ["train.sharding=none"]), ("LoRA", "fsdp", ["train.sharding=fsdp"]),
            ("full", "none", ["train.lora_rank=0", "train.sharding=none"]),
            ("full", "fsdp", ["train.lora_rank=0", "train.sharding=fsdp"]))


def summary_row(recipe: str, train: str, sharding: str, plan: Plan) -> str:
    """One markdown row of docs/memory.md's table: resident, the recipe's training activations, the
    largest rollout (or generation) transient and the peak, GiB per GPU."""
    act = sum(i.bytes for i in plan.items if i.group == "train" and i.name.startswith("activations"))
    transient = max((i.bytes for i in plan.items if i.group == "transient"), default=0)
    fit = "fits" if plan.fits else "no"
    return (f"| {recipe} | {train} | {sharding} | {plan.resident_bytes / GiB:.1f} | {act / GiB:.1f} | "
            f"{transient / GiB:.1f} | {plan.peak_bytes / GiB:.1f} ({fit}) |")


def summary_table(recipes: list[str], gpus: int = 8, gpu_memory: int = 80 * GiB, *, train: tuple = ("LoRA", "full"),
                  overrides: tuple = (), label: str = "") -> str:
    """docs/memory.md's table of the shipped recipes: each with LoRA / full fine-tune (``train``), DDP
    replicas / FSDP (on one GPU replicas only: FSDP over one process divides nothing), under ``overrides``
    (e.g. another published model), named ``stem label``."""
    from ..trainers.config import load_config
    from .core import plan_memory

    lines = ["| recipe | train | sharding | resident | act | transient | peak per GPU |",
             "|---|---|---|---|---|---|---|"]
    for recipe in recipes:
        name = f"{Path(recipe).stem} {label}".strip()
        for kind, sharding, variant in VARIANTS:
            if kind in train and (gpus > 1 or sharding == "none"):
                plan = plan_memory(load_config(recipe, list(overrides) + variant), gpus, gpu_memory, recipe)
                lines.append(summary_row(name, kind, sharding, plan))
    return "\n".join(lines)


def _main(argv: list[str]) -> None:
    """``python -m flowrl.plan.report [--gpus N] [--gpu-memory 80GiB] [--train LoRA] [--label TEXT]
    RECIPE... [--set KEY=VALUE ...]``: the table in docs/memory.md."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flowrl.plan.report")
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-memory", default="80GiB")
    ap.add_argument("--train", choices=("LoRA", "full"), action="append", help="only these (default: both)")
    ap.add_argument("--label", default="", help="appended to each recipe's name (e.g. the model an override picks)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of every recipe")
    a = ap.parse_args(argv)
    print(summary_table(a.recipes, a.gpus, parse_memory(a.gpu_memory), train=tuple(a.train or ("LoRA", "full")),
                        overrides=tuple(a.set), label=a.label))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
