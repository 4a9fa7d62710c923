"""``flowrl plan``: the per-GPU memory plan of a recipe (table, JSON, knobs; ``--measure`` checks it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _memory(text: str) -> int:
    from .report import parse_memory

    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _gpus(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--gpus {text!r}: give a positive number of processes (one GPU each)")
    return int(text)


def plan_command(a) -> int:
    from ..trainers.config import load_config
    from .core import plan_memory
    from .knobs import suggest
    from .report import format_measure, format_plan, plan_json

    cfg = load_config(a.config, a.overrides)
    plan = plan_memory(cfg, a.gpus, a.gpu_memory, str(a.config))
    if not plan.fits:
        plan.knobs = list(suggest(a.config, a.overrides, plan))
    print(format_plan(plan))
    out = plan_json(plan)
    if a.suggest:
        from .suggest import format_suggestion, suggest

        out["suggest"] = suggest(a.config, a.overrides, a.gpu_memory, a.max_gpus)
        print(format_suggestion(out["suggest"], a.config, a.gpu_memory))
    if a.measure:
        from .measure import measure_recipe

        out["measured"] = measure_recipe(cfg)
        print(format_measure(out["measured"]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


def add_plan_parser(sub) -> None:
    """`flowrl plan`: register the sub-command on the top-level sub-parsers."""
    p = sub.add_parser("plan", help="per-GPU memory plan of a recipe (meta-device models, no download)")
    p.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/sd3_group_pickscore.yaml")
    p.add_argument("--gpus", type=_gpus, default=1, help="processes (one GPU each); FSDP shards over them, "
                   "train.context_parallel=C groups them by C")
    p.add_argument("--gpu-memory", type=_memory, default="80GiB",
                   help="memory per GPU: 80GiB, 80GB (10^9 bytes), 141GiB, or a number of GiB")
    p.add_argument("--json", default=None, help="also write the plan (and --measure's result) as JSON here")
    p.add_argument("--measure", action="store_true", help="also measure the real peak of a training pass and a "
                   "sampling forward of the recipe's model (CUDA: torch.cuda.max_memory_allocated; CPU: profiler)")
    p.add_argument("--suggest", action="store_true", help="also name the smallest setting (GPUs, FSDP x context "
                   "parallel, offload, gradient checkpointing) that fits --gpu-memory, and why the next smaller does not")
    p.add_argument("--max-gpus", type=_gpus, default=64, help="the largest GPU count --suggest tries (default 64)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.sharding=fsdp train.lora_rank=0")
    p.set_defaults(fn=plan_command)
