"""``flowrl bench precision --pipeline NAME-arch`` (``sd35m-arch``, ``sd35l-arch``, ``flux-arch``, ``sana-arch``,
``qwen-image-arch``, ``flux-kontext-arch``, ``wan-1.3b-arch``, ``wan-14b-arch``, ``qwen-image-edit-arch``,
``qwen-image-edit-2511-arch``: every published model an adapter
declares with an ``arch`` name): exploration backends on full-size architectures with random weights (no
download), on a CUDA GPU. A video architecture samples ``model_options['num_frames']`` frames per video at
each square resolution (``--num-frames``; default the pipeline's 81): "images" below are then videos.

Per backend (``full`` = the bf16 policy, then each quantized copy, one at a time so only one copy
is resident beside the policy), per resolution (default 512 and 1024 px):

* ``images_per_second``: deterministic ODE sampling of ``batch`` images in ``steps`` steps (median
  of ``repeats`` runs after warm-up, CUDA events), and ``speedup_vs_full``;
* ``forward_ms``: one bare transformer forward at that batch (median, CUDA events), and its
  speed-up: the model's own gain, without the sampler's host work;
* ``peak_mb``: ``torch.cuda.max_memory_allocated`` while sampling (policy + copy + activations);
* ``velocity_rel_error``: ``||v_q - v_full|| / ||v_full||`` on one fixed input (numerics check);
* ``sync_seconds``: building the copy (merge, quantize, calibrate once), Sol-RL's per-update cost;
* ``real_kernels`` / ``kernel`` / ``label``: simulated backends are labelled ``(simulated)`` and
  their speed-ups carry a ``*``.

Reward-ranking fidelity is off (random weights). ``compile`` (a ``model.compile`` mode) measures every
backend (``full`` included) eagerly and then compiled as ``model.compile`` compiles a rollout
(:func:`flowrl.utils.compile.compile_rollouts`): the same fields under ``backends.<spec>.compiled``
(:mod:`flowrl.bench.precision_compiled`), with the compiled run's recompiles and its speed-ups over the
backend's eager run and over full precision, eager and compiled. ``tiny=True`` shrinks the configs so the
code path runs on a CPU in seconds (tests); without it a CPU gets a clear error. ``iteration_timing`` adds one
Sol-RL and one flat-GRPO iteration (:mod:`flowrl.bench.precision_iteration`), compiled when ``compile`` is.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..quant.common import BackendUnavailable, module_bytes
from ..quant.kernels import display_label, kernel_info
from ..types import swapped_transformer
from ..rollout.ode import ode_sample
from ..seeding import derive_seeds
from .precision_arch_models import ArchPolicy, arch_model
from .precision_arch_report import plot_arch
from .precision_measure import PeakMemory, machine_info, sync_device, timed, write_outputs
from ..utils.compile import check_mode, compile_rollouts, eager_forwards
from ..utils.paths import resolve_device
from .precision_compiled import compiled_entry, compiled_speedups, rel_error, velocity_input

PROMPTS = ["a photo of a cat on a sofa", "a red bicycle leaning on a brick wall"]
ARCH_SEED = 20260410


def check_arch_device(pipeline: str, device: torch.device, tiny: bool) -> None:
    """Full-size architectures need CUDA; ``tiny`` runs anywhere."""
    _, model = arch_model(pipeline)
    if device.type != "cuda" and not tiny:
        why = "torch.cuda.is_available() is False" if not torch.cuda.is_available() else f"the device is {device}"
        raise BackendUnavailable(f"--pipeline {pipeline} builds the full-size {model.title} architecture and "
                           f"times it with CUDA events: it needs a CUDA GPU ({why}). On this machine use --pipeline "
                           f"sd3-mid (a 36M-parameter SD3 that times int8 on a CPU), or --tiny to run this code path "
                           f"on shrunken configs")


def time_resolution(policy: ArchPolicy, module, batch: int, steps: int, repeats: int, warmups: int,
                    compiled=None) -> tuple[dict, torch.Tensor]:
    """Sampling and forward timings of ``module`` at the policy's current resolution -> (row, velocity [B, ...]);
    eager unless ``compiled`` (the :class:`~flowrl.utils.compile.CompileLog` of ``module``'s compiled forward:
    the row then has ``compile_seconds`` of its warm-up and ``recompiles_timed``, the compiles of its timed runs)."""
    dev = policy.device
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    seeds = derive_seeds(ARCH_SEED, batch)
    x, sigma, cond = velocity_input(policy, [PROMPTS[i % len(PROMPTS)] for i in range(batch)],
                                    derive_seeds(ARCH_SEED + 7, batch))
    done = (lambda: compiled.compiles + compiled.recompiles) if compiled is not None else (lambda: 0)
    spent = compiled.compile_seconds if compiled is not None else 0.0
    with torch.no_grad(), swapped_transformer(policy, module), \
            eager_forwards(compiled is None):
        for _ in range(warmups):
            ode_sample(policy, prompts, seeds, steps, batch)
            policy.velocity(x, sigma, cond)
        after_warmup = done()
        runs, peak = [], None
        for i in range(repeats):
            with PeakMemory(dev) as mem:
                runs.append(timed(lambda: ode_sample(policy, prompts, seeds, steps, batch), dev))
            if i == 0 and mem.cuda:
                peak = mem.peak / 2**20
        fwd = [timed(lambda: policy.velocity(x, sigma, cond), dev) for _ in range(max(repeats, 3))]
        v = policy.velocity(x, sigma, cond).float().cpu()  # [B, 16, h, w]
    med = statistics.median(runs)
    row = {"seconds_per_batch": med, "seconds_all": runs, "images_per_second": batch / med,
           "forward_ms": 1000.0 * statistics.median(fwd), "peak_mb": peak}
    if compiled is not None:
        row.update({"compile_seconds": compiled.compile_seconds - spent, "recompiles_timed": done() - after_warmup})
    return row, v


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_copy(policy: ArchPolicy, q, calibrate, device: torch.device) -> tuple[torch.nn.Module, float]:
    """Quantize ``policy.transformer`` with ``q`` -> (copy, seconds)."""
    sync_device(device)
    t0 = time.perf_counter()
    module = q.quantize(policy.transformer, calibrate if q.needs_calibration else None)
    sync_device(device)
    return module, time.perf_counter() - t0


def measure_backend(policy: ArchPolicy, spec: str, module, resolutions, settings: dict, reference: dict,
                    log) -> tuple[dict, Optional[dict]]:
    """Every resolution of one backend, eager, then compiled when ``settings["compile"]`` is not ``off`` ->
    (eager rows by px, the compiled entry or None); ``reference`` (``px -> velocity``) is filled by ``full``."""
    out, eager_v = {}, {}
    for px in resolutions:
        policy.set_resolution(px)
        row, v = time_resolution(policy, module, settings["batch"], settings["steps"], settings["repeats"], 1)
        if spec == "full":
            reference[px] = v
        eager_v[px] = v
        row["velocity_rel_error"] = rel_error(v, reference[px])
        out[str(px)] = row
        log(f"[bench precision] {spec} @ {px}px: {row['images_per_second']:.3f} img/s, forward "
            f"{row['forward_ms']:.1f} ms, rel. error {row['velocity_rel_error']:.2e}", flush=True)
    if settings["compile"] == "off":
        return out, None
    clog = compile_rollouts(module, settings["compile"], role=spec)
    rows = {}
    try:
        for px in resolutions:
            policy.set_resolution(px)
            row, v = time_resolution(policy, module, settings["batch"], settings["steps"], settings["repeats"], 2,
                                     compiled=clog)
            row.update({"velocity_rel_error": rel_error(v, reference[px]),
                        "velocity_rel_error_vs_eager": rel_error(v, eager_v[px])})
            rows[str(px)] = row
            log(f"[bench precision] {spec} compiled ({settings['compile']}) @ {px}px: {row['images_per_second']:.3f} "
                f"img/s, forward {row['forward_ms']:.1f} ms, compile {row['compile_seconds']:.1f}s, "
                f"{row['recompiles_timed']} recompiles after warm-up", flush=True)
    finally:
        compile_rollouts(module, "off")
    return out, compiled_entry(settings["compile"], clog, rows)


def _speedups(results: dict, resolutions) -> None:
    for r in results.values():
        for px in resolutions:
            row, full = r["resolutions"][str(px)], results["full"]["resolutions"][str(px)]
            row["speedup_vs_full"] = full["seconds_per_batch"] / row["seconds_per_batch"]
            row["forward_speedup_vs_full"] = full["forward_ms"] / row["forward_ms"]
    compiled_speedups(results, [str(px) for px in resolutions])


def save_partial(out: dict, json_path, note: str) -> None:
    """Write what is measured so far to ``json_path`` (atomic), ``partial`` saying how far it got: a run cut
    short (a GPU session's time cap) leaves the backends it finished. The finished run overwrites it."""
    if json_path:
        from ..utils.io import write_json

        write_json({**out, "partial": note}, Path(json_path))


def bench_arch(pipeline: str = "sd35m-arch", backends: Optional[Sequence[str]] = None,
               json_path: Optional[str | Path] = None, *, png_path: Optional[str | Path] = None,
               resolutions: Sequence[int] = (512, 1024), batch: Optional[int] = None, steps: Optional[int] = None,
               repeats: int = 3, compile: str = "off", device: Optional[str] = None, dtype: Optional[str] = None,
               tiny: bool = False, iteration_timing: bool = False, iteration_options: Optional[dict] = None,
               iteration_only: bool = False,
               model_options: Optional[dict] = None,
               verbose: bool = True) -> dict:
    """Run the architecture benchmark (module doc); returns the result dict (also written to
    ``json_path``, a PNG chart beside it). ``backends``: as ``bench_precision`` (default ``full, fp8,
    nvfp4`` on CUDA). ``iteration_only``: time the iterations alone (no backend is timed; a GPU session's
    minutes go to the iteration)."""
    from .precision import build_quantizers, default_backends

    dev = resolve_device(device or None)
    check_arch_device(pipeline, dev, tiny)
    check_mode(compile, "compile")  # before anything is built
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    specs = list(backends) if backends else default_backends(dev)
    specs = ["full"] + [s for s in specs if s != "full"]
    quantizers = build_quantizers(specs)  # unavailable backends fail here, before the model is built
    resolutions = [int(r) for r in resolutions]
    settings = {"batch": int(batch or (2 if tiny else 4)), "steps": int(steps or 6), "repeats": int(repeats),
                "resolutions": resolutions, "compile": compile, "calibration_prompts": len(PROMPTS)}
    if min(settings["batch"], settings["steps"], settings["repeats"]) < 1 or not resolutions:
        raise ValueError(f"batch, steps and repeats must be >= 1 and resolutions non-empty, got {settings}")
    log = print if verbose else (lambda *a, **k: None)
    title = arch_model(pipeline)[1].title
    log(f"[bench precision] building {pipeline} ({title}{', tiny' if tiny else ''}) on {dev} in "
        f"{dtype} ...", flush=True)
    policy = ArchPolicy(pipeline, resolutions[0], dev, getattr(torch, dtype), tiny=tiny, options=model_options)

    def calibrate(module: torch.nn.Module) -> None:
        policy.set_resolution(resolutions[0])
        with torch.no_grad(), swapped_transformer(policy, module):
            ode_sample(policy, PROMPTS, derive_seeds(ARCH_SEED + 1, len(PROMPTS)), settings["steps"])

    results: dict[str, dict] = {}
    reference: dict[int, torch.Tensor] = {}
    out = {"pipeline": pipeline, "tiny": tiny, "device": str(dev), "dtype": dtype,
           "arch": {"title": policy.model.title, "family": policy.family, "config": policy.config,
                    "config_source": f"{policy.model.source} transformer/config.json",
                    "parameters": policy.parameters_count(),
                    "text_tokens": policy.text_tokens, "frames": policy.geometry.frames},
           "settings": settings, "machine": machine_info(), "backends": results,
           "fidelity_note": "fidelity off: random weights (speed, memory and numerics vs full precision only)"}
    for spec in [] if iteration_only else specs:
        if spec == "full":
            module, sync_s = policy.transformer, 0.0
        else:
            log(f"[bench precision] building {spec} copy ...", flush=True)
            module, sync_s = build_copy(policy, quantizers[spec], calibrate, dev)
        info = kernel_info(spec, module)
        label = display_label(spec, info)
        log(f"[bench precision] {label}: sync {sync_s:.2f}s, kernels: {info['kernel']}", flush=True)
        rows, compiled = measure_backend(policy, spec, module, resolutions, settings, reference, log)
        results[spec] = {"backend": spec, "label": label, **info, "sync_seconds": sync_s,
                         "model_mb": module_bytes(module) / 2**20, "resolutions": rows,
                         **({"compiled": compiled} if compiled else {})}
        if spec != "full":
            del module
            _release(dev)
        _speedups(results, resolutions)
        save_partial(out, json_path, f"{len(results)} of {len(specs)} backends measured")
    if iteration_timing or iteration_only:
        from .precision_iteration import time_iterations

        save_partial(out, json_path, "every backend measured; the iteration timing did not finish")
        out["iteration_timing"] = time_iterations(policy, quantizers, log=log, compile=compile,
                                                  **(iteration_options or {}))
    return write_outputs(out, json_path, png_path, log, plot_arch)
