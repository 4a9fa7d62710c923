"""The ``flowrl bench precision`` command line: argument definitions and dispatch.

``--pipeline digits | sd3-mid | sd3 | flux`` runs :func:`flowrl.bench.precision.bench_precision`;
``--pipeline NAME-arch`` (``sd35m-arch``, ``sd35l-arch``, ``flux-arch``, ``sana-arch``: the published models
the adapters declare, :func:`flowrl.bench.precision_arch_models.arch_models`) runs
:func:`flowrl.bench.precision_arch.bench_arch`. The architecture names are read from the adapters only
when an unknown name is given (listing them imports every adapter).
"""
from __future__ import annotations

import argparse
from typing import Optional

from ..command_line import positive_int
from ..errors import BenchError
from ..utils.compile import COMPILE_MODES
from .precision_policy import PIPELINES

ITERATION_FLAGS = ("pool_size", "preview_steps", "keep", "group_size", "train_steps", "minibatch", "lora_rank",
                   "iteration_resolution", "explore_backend")


def _ints(text: Optional[str]) -> Optional[list[int]]:
    """``"512,1024"`` -> [512, 1024] (None stays None)."""
    if text is None:
        return None
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise BenchError(f"{text!r} is not a comma-separated list of integers, e.g. 512,1024") from None
    if not values or min(values) < 1:
        raise BenchError(f"{text!r}: give positive integers, e.g. 512,1024")
    return values


def _pipeline(text: str) -> str:
    """``--pipeline``: a precision pipeline or an architecture name an adapter declares."""
    if text in PIPELINES:
        return text
    from .precision_arch_models import arch_models

    archs = sorted(arch_models())
    if text not in archs:
        valid = ", ".join(PIPELINES + tuple(archs))
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {valid})")
    return text


def _iteration_options(a) -> dict:
    opts = {k: getattr(a, k) for k in ITERATION_FLAGS if getattr(a, k) is not None}
    if "iteration_resolution" in opts:
        opts["resolution"] = opts.pop("iteration_resolution")
    return opts


def _run(a) -> str:
    """Run the benchmark (progress on stderr under the CLI); returns the table for stdout."""
    backends = [b.strip() for b in a.backends.split(",") if b.strip()] if a.backends else None
    if a.pipeline not in PIPELINES:
        from .precision_arch import bench_arch
        from .precision_arch_report import format_arch_table

        return format_arch_table(bench_arch(
            a.pipeline, backends, a.json, png_path=a.png, resolutions=_ints(a.resolutions) or (512, 1024),
            batch=a.batch, steps=a.steps, repeats=a.repeats, compile=a.compile, device=a.device, dtype=a.dtype,
            tiny=a.tiny, iteration_timing=a.iteration_timing, iteration_options=_iteration_options(a),
            iteration_only=a.iteration_only,
            model_options={"num_frames": a.num_frames} if a.num_frames else None))
    arch_only = [f for f, on in (("--tiny", a.tiny), ("--iteration-timing", a.iteration_timing),
                                 ("--iteration-only", a.iteration_only),
                                 ("--resolutions", a.resolutions), ("--num-frames", a.num_frames)) if on]
    if arch_only:
        raise BenchError(f"{', '.join(arch_only)} apply to the architecture pipelines (NAME-arch), "
                         f"not --pipeline {a.pipeline}")
    from .precision import bench_precision
    from .precision_report import format_table

    return format_table(bench_precision(
        a.pipeline, backends, a.json, png_path=a.png, model_path=a.model_path, batch=a.batch, steps=a.steps,
        repeats=a.repeats, seeds_per_prompt=a.seeds_per_prompt, fidelity_steps=_ints(a.fidelity_steps),
        ref_steps=a.ref_steps, topk=a.topk, reward=a.reward, device=a.device, dtype=a.dtype, threads=a.threads,
        batch_check=not a.no_batch_check, compile=a.compile))


def _add_arch_arguments(p) -> None:
    g = p.add_argument_group("architecture pipelines (NAME-arch, e.g. sd35m-arch, flux-arch: random weights, CUDA)")
    g.add_argument("--resolutions", default=None, help="comma-separated image sides in px (default 512,1024)")
    g.add_argument("--tiny", action="store_true", help="shrunken configs (runs on a CPU in seconds: tests, smoke)")
    g.add_argument("--num-frames", type=int, default=None,
                   help="video architectures (wan-*-arch): frames per video, 4 k + 1 (default: the pipeline's 81)")
    g.add_argument("--iteration-timing", action="store_true",
                   help="also time one Sol-RL and one flat-GRPO iteration (explore, regenerate, update)")
    g.add_argument("--iteration-only", action="store_true",
                   help="time only those iterations (no backend timed: --explore-backend names Sol-RL's)")
    g.add_argument("--explore-backend", default=None, help="Sol-RL exploration backend (default: first quantized)")
    g.add_argument("--iteration-resolution", type=positive_int, default=None, help="iteration timing px (default 512)")
    for flag, hint in (("--pool-size", "Sol-RL seeds explored per prompt (default 96)"),
                       ("--preview-steps", "Sol-RL exploration ODE steps (default 6)"),
                       ("--keep", "Sol-RL seeds regenerated per prompt (default 24)"),
                       ("--group-size", "flat-GRPO samples per prompt (default: keep)"),
                       ("--train-steps", "SDE steps of regeneration / flat GRPO (default 10)"),
                       ("--minibatch", "transitions per optimizer step (default 4)"),
                       ("--lora-rank", "LoRA rank of the timed update (default 32)")):
        g.add_argument(flag, type=positive_int, default=None, help=hint)


def add_precision_parser(subparsers) -> None:
    """Add ``precision`` to ``flowrl bench``'s subparsers."""
    p = subparsers.add_parser("precision", help="exploration backends side by side: images/s, speed-up, memory, "
                                                "reward-ranking fidelity (Sol-RL); full-size architectures on CUDA",
                              epilog="example:\n  flowrl bench precision --pipeline sd3-mid --backends "
                                     "full,int8-dynamic --json bench/precision.json")
    p.add_argument("--pipeline", type=_pipeline, default="digits",
                   help="digits / sd3-mid (CPU-sized), sd3 / flux (--model-path), or a full-size architecture with "
                        "random weights declared by a model adapter, e.g. sd35m-arch or flux-arch (CUDA GPU; an "
                        "unknown name lists them all)")
    p.add_argument("--backends", default=None,
                   help="comma-separated: full and flowrl.quant backends, options as name:key=value "
                        "(default: full,int8-dynamic,nvfp4-emulated on CPU; full,fp8,nvfp4 on CUDA)")
    p.add_argument("--json", default=None, help="write the result here (a PNG chart goes beside it)")
    p.add_argument("--png", default=None, help="chart path (default: the JSON path with .png)")
    p.add_argument("--model-path", default=None, help="digits base / diffusers directory (default: the digits cache)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="timing batch (default: 96 digits, 2 sd3-mid/sd3/flux, 4 arch)")
    p.add_argument("--steps", type=positive_int, default=None, help="timing ODE steps (default: 6 digits/arch, 4 sd3-mid)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per backend after one warm-up")
    p.add_argument("--seeds-per-prompt", type=int, default=None, help="fidelity pool per prompt (0 = no fidelity)")
    p.add_argument("--fidelity-steps", default=None, help="comma-separated step counts (default 6,20 on digits)")
    p.add_argument("--ref-steps", type=positive_int, default=None, help="full-precision reference steps (default 20)")
    p.add_argument("--topk", type=positive_int, default=12,
                   help="k of the fidelity's top-k hit rate (per prompt, against full precision's ranking)")
    p.add_argument("--reward", default=None, help="reward name (default: digits, else jpeg_compressibility)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-batch-check", action="store_true", help="skip the batch-mates sensitivity pass")
    p.add_argument("--compile", choices=COMPILE_MODES, default="off",
                   help="also time every backend compiled as model.compile compiles a rollout, beside its eager run "
                        "(reduce-overhead: + CUDA graphs); with --iteration-timing the iterations' rollouts too")
    _add_arch_arguments(p)
    p.set_defaults(fn=_run)
