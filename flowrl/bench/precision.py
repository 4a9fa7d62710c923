"""``flowrl bench precision``: exploration backends side by side (Sol-RL, arXiv 2604.06916).

For each backend, in one run on one machine state:

* **speed**: images/s of deterministic ODE sampling at a fixed batch and step count (median
  of ``repeats`` timed runs after a warm-up; the backends' runs are interleaved round by
  round so a change of machine load hits them alike), and the speed-up vs full precision;
* **kernels**: whether the copy runs real low-precision GEMMs (``"real_kernels"``); a
  simulated backend is labelled ``name (simulated)`` in the table, the logs and the JSON, and
  its speed-up carries a ``*``;
* **memory**: bytes of the model copy, and the memory growth while sampling (CPU: resident
  memory sampled every 5 ms after returning freed heap to the OS; CUDA: peak allocation);
* **fidelity**: reward-ranking agreement with full precision at ``ref_steps`` on the same
  seeds, within each prompt's pool: Kendall tau, Spearman, top-k hit rate, at every step
  count of ``fidelity_steps`` (full precision at few steps is the "fewer steps" baseline);
* **batch sensitivity**: the same pool run again with every sample among other batch-mates
  (same chunk size): the largest reward change and the Kendall tau between the two runs;
* **sync**: the seconds to build the copy (merge, quantize, calibrate): Sol-RL's per-update cost;
* **compiled** (``compile``, a ``model.compile`` mode): each backend also timed compiled as a rollout is
  (in the same interleaved rounds), with its forward ms, memory, recompiles and velocity error beside the
  eager ones (``backends.<spec>.compiled``, :mod:`flowrl.bench.precision_compiled`).

Pipelines: ``digits`` (the pretrained offline base; rewards meaningful), ``sd3-mid`` (a
random-init ``SD3Transformer2DModel`` of 36.0M parameters at 1024 tokens: the size where int8
pays off on a CPU; fidelity off, its speed is real), ``sd3`` / ``flux`` (``model_path`` to a
diffusers directory). Full-size architectures without weights (``sd35m-arch``, ``sd35l-arch``,
``flux-arch``, CUDA) are :mod:`flowrl.bench.precision_arch`; the command line routes them there.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..quant import get_quantizer, parse_backend_spec
from ..quant.common import module_bytes
from ..quant.fidelity import kendall_tau, ranking_fidelity
from ..quant.kernels import display_label, kernel_info
from ..types import swapped_transformer
from ..scoring import score_images
from ..rollout.ode import ode_sample
from ..seeding import derive_seeds
from ..utils.compile import check_mode, eager_forwards
from ..utils.paths import resolve_device
from .precision_compiled import add_compiled, finish_compiled, velocity_input
from .precision_measure import PeakMemory, machine_info, sync_device, timed, write_outputs
from .precision_policy import PIPELINES, SD3MidPolicy, build_bench_policy, build_reward, sd3_mid_config
from .precision_report import format_table, plot_precision

BENCH_SEED = 20260408
CALIBRATION_SEED = 20260409
GENERIC_PROMPTS = ["a photo of a cat on a sofa", "a red bicycle leaning on a brick wall",
                   "a bowl of fruit on a wooden table", "a lighthouse at sunset"]
DEFAULTS = {  # per pipeline: timing batch and steps, fidelity pool and step counts, reference steps
    "digits": dict(batch=96, steps=6, seeds_per_prompt=96, fidelity_steps=(6, 20), ref_steps=20, reward="digits"),
    "sd3-mid": dict(batch=2, steps=4, seeds_per_prompt=0, fidelity_steps=(4,), ref_steps=8,
                    reward="jpeg_compressibility"),
    "sd3": dict(batch=2, steps=6, seeds_per_prompt=16, fidelity_steps=(6,), ref_steps=20,
                reward="jpeg_compressibility"),
    "flux": dict(batch=2, steps=6, seeds_per_prompt=16, fidelity_steps=(6,), ref_steps=20,
                 reward="jpeg_compressibility"),
}


def default_backends(device: torch.device) -> list[str]:
    """``full, fp8, nvfp4`` on CUDA; ``full, int8-dynamic, nvfp4-emulated`` on a CPU."""
    return ["full", "fp8", "nvfp4"] if device.type == "cuda" else ["full", "int8-dynamic", "nvfp4-emulated"]


def build_quantizers(specs: list[str]) -> dict[str, Any]:
    """``spec -> quantizer`` for every spec but ``full``; a backend that cannot run here raises
    :class:`~flowrl.quant.BackendUnavailable` naming those that can (before any model loads)."""
    out = {}
    for spec in specs:
        if spec != "full":
            name, opts = parse_backend_spec(spec)
            out[spec] = get_quantizer(name, **opts)
    return out


def _sample(policy, module, prompts: list[str], seeds: list[int], steps: int, max_batch: Optional[int],
            compiled: bool = False):
    """ODE samples of ``module`` in ``policy``: eager unless ``compiled`` (its compiled forward then runs)."""
    with torch.no_grad(), swapped_transformer(policy, module), \
            eager_forwards(not compiled):
        return ode_sample(policy, prompts, seeds, steps, max_batch)


def _pool_rewards(policy, module, reward, prompts, seeds, steps, chunk, order: Optional[torch.Tensor] = None):
    """Rewards [N] of the pool (prompts[i], seeds[i]) at ``steps``; ``order`` permutes which
    samples share a chunk (results are returned in pool order)."""
    idx = torch.arange(len(seeds)) if order is None else order
    p = [prompts[i] for i in idx.tolist()]
    s = [seeds[i] for i in idx.tolist()]
    _, images = _sample(policy, module, p, s, steps, chunk)
    r, _ = score_images(reward, images, p)
    out = torch.empty_like(r)
    out[idx] = r
    return out


def build_copies(policy, quantizers: dict[str, Any], calibrate, device: torch.device, log) -> tuple[dict, dict]:
    """Each backend's copy of ``policy.transformer`` -> (``spec -> module``, ``spec -> result row``
    with sync seconds, kernel description and label)."""
    modules: dict[str, torch.nn.Module] = {"full": policy.transformer}
    results: dict[str, dict] = {"full": {"backend": "full", "sync_seconds": 0.0, **kernel_info("full")}}
    for spec, q in quantizers.items():
        log(f"[bench precision] building {spec} copy ...", flush=True)
        sync_device(device)
        t0 = time.perf_counter()
        modules[spec] = q.quantize(policy.transformer, calibrate if q.needs_calibration else None)
        sync_device(device)
        dt = time.perf_counter() - t0
        info = kernel_info(spec, modules[spec])
        results[spec] = {"backend": spec, "sync_seconds": dt, **info}
        log(f"[bench precision] {display_label(spec, info)}: built in {dt:.2f}s, kernels: {info['kernel']}", flush=True)
    for spec, m in modules.items():
        results[spec]["model_mb"] = module_bytes(m) / 2**20
        results[spec]["label"] = display_label(spec, results[spec])
    return modules, results


def time_interleaved(policy, modules: dict, results: dict, prompts, seeds, steps: int, batch: int, repeats: int,
                     device: torch.device, log) -> None:
    """Timed sampling rounds, backends interleaved (round 0 is the warm-up); fills ``results``. A key
    ``"<backend> compiled"`` of ``modules`` and ``results`` runs that backend's module compiled."""
    specs = list(modules)
    times: dict[str, list[float]] = {s: [] for s in specs}
    peaks: dict[str, list[Optional[int]]] = {s: [] for s in specs}
    for rnd in range(repeats + 1):
        for spec in specs:
            with PeakMemory(device) as mem:
                dt = timed(lambda spec=spec: _sample(policy, modules[spec], prompts, seeds, steps, batch,
                                                     spec.endswith(" compiled")), device)
            if rnd > 0:
                times[spec].append(dt)
                peaks[spec].append(None if mem.peak is None else mem.peak - (mem.base or 0))
                if rnd == 1:
                    results[spec]["peak_mb"] = None if mem.peak is None else mem.peak / 2**20
        log(f"[bench precision] timing round {rnd}/{repeats}" + (" (warm-up)" if rnd == 0 else "") + ": " +
            ", ".join(f"{results[s]['label']} {times[s][-1]:.2f}s" for s in specs if times[s]), flush=True)
    full_med, full_best = statistics.median(times["full"]), min(times["full"])  # full precision, eager
    for spec in specs:
        med, best = statistics.median(times[spec]), min(times[spec])
        r = results[spec]
        r.update({"seconds_per_batch": med, "seconds_all": times[spec], "images_per_second": batch / med,
                  "speedup_vs_full": full_med / med,  # ratio of medians
                  "speedup_vs_full_best": full_best / best})  # ratio of best runs (least disturbed by load)
        extra = [p for p in peaks[spec] if p is not None]
        r["peak_extra_mb"] = max(extra) / 2**20 if extra else None


def measure_fidelity(policy, modules, results, reward_fn, pool_prompts, pool_seeds, groups, fsteps, ref_steps,
                     batch, topk, batch_check: bool, log) -> None:
    """Ranking fidelity vs full precision at ``ref_steps`` (and the batch check); fills ``results``."""
    log(f"[bench precision] reference: full precision, {ref_steps} steps, {len(pool_seeds)} samples", flush=True)
    ref = _pool_rewards(policy, modules["full"], reward_fn, pool_prompts, pool_seeds, ref_steps, batch)
    for spec, module in modules.items():
        res = results[spec]
        res["fidelity"] = {}
        for fs in fsteps:
            r = ref if (spec == "full" and fs == ref_steps) else \
                _pool_rewards(policy, module, reward_fn, pool_prompts, pool_seeds, fs, batch)
            fid = ranking_fidelity(ref, r, groups, k=topk)
            fid["reward_mean"] = float(r[torch.isfinite(r)].mean())
            res["fidelity"][str(fs)] = fid
            if batch_check and fs == fsteps[0]:
                res["batch_check"] = _batch_check(policy, module, reward_fn, pool_prompts, pool_seeds, fs, batch, r,
                                                  groups)
            log(f"[bench precision] {res['label']} @ {fs} steps: tau {fid['kendall_tau']:.3f} "
                f"spearman {fid['spearman']:.3f} top-{topk} {fid['topk_hit_rate']:.3f}", flush=True)
    results["full"]["reference_reward_mean"] = float(ref[torch.isfinite(ref)].mean())


def _default_prompts(pipeline: str) -> list[str]:
    if pipeline == "digits":
        from ..data.digits import digit_prompt

        return [digit_prompt(d) for d in range(10)]
    return list(GENERIC_PROMPTS)


def bench_precision(pipeline: str = "digits", backends: Optional[Sequence[str]] = None,
                    json_path: Optional[str | Path] = None, *, png_path: Optional[str | Path] = None,
                    model_path: Optional[str] = None, batch: Optional[int] = None, steps: Optional[int] = None,
                    repeats: int = 3, seeds_per_prompt: Optional[int] = None, prompts: Optional[list[str]] = None,
                    fidelity_steps: Optional[Sequence[int]] = None, ref_steps: Optional[int] = None, topk: int = 12,
                    reward: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                    threads: Optional[int] = None, batch_check: bool = True, calibration_seeds: int = 2,
                    compile: str = "off", policy=None, verbose: bool = True) -> dict:
    """Run the precision benchmark (module doc) and return the result dict (also written to
    ``json_path``, with a PNG chart at ``png_path``, default beside the JSON).

    ``backends``: specs ``name`` or ``name:key=value`` from ``flowrl.quant`` plus ``"full"``
    (the unquantized policy, always measured as the reference); default ``full,
    int8-dynamic, nvfp4-emulated`` on a CPU and ``full, fp8, nvfp4`` on CUDA. A backend that
    cannot run here fails before any model loads, naming those that can. ``policy``: an
    already built ``FlowPolicy`` to measure instead of loading ``pipeline`` / ``model_path``. ``compile``:
    a ``model.compile`` mode; each backend is then also timed compiled (module doc).
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown pipeline {pipeline!r}; valid: {', '.join(PIPELINES)} (full-size architectures "
                         f"without weights: flowrl.bench.precision_arch.bench_arch)")
    dflt = DEFAULTS[pipeline]
    check_mode(compile, "compile")
    dev = resolve_device(device or None)
    dtype = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    specs = list(backends) if backends else default_backends(dev)
    if "full" not in specs:
        specs.insert(0, "full")
    quantizers = build_quantizers(specs)
    batch, steps = int(batch or dflt["batch"]), int(steps or dflt["steps"])
    spp = int(dflt["seeds_per_prompt"] if seeds_per_prompt is None else seeds_per_prompt)
    fsteps = [int(s) for s in (fidelity_steps or dflt["fidelity_steps"])]
    ref_steps = int(ref_steps or dflt["ref_steps"])
    if repeats < 1 or batch < 1 or steps < 1:
        raise ValueError(f"repeats, batch and steps must be >= 1, got {repeats}, {batch}, {steps}")
    if threads:
        torch.set_num_threads(int(threads))
    log = print if verbose else (lambda *a, **k: None)

    policy = policy if policy is not None else build_bench_policy(pipeline, model_path, str(dev), getattr(torch, dtype))
    reward_name = reward or dflt["reward"]
    reward_fn = build_reward(reward_name, str(dev))
    prompts = list(prompts) if prompts is not None else _default_prompts(pipeline)
    pool_prompts = [p for p in prompts for _ in range(spp)]
    pool_seeds = derive_seeds(BENCH_SEED, len(pool_prompts))
    groups = torch.arange(len(prompts)).repeat_interleave(spp)
    cal_prompts = [p for p in prompts for _ in range(calibration_seeds)]
    cal_seeds = derive_seeds(CALIBRATION_SEED, len(cal_prompts))
    cal_steps = min(fsteps + [steps])

    def calibrate(module: torch.nn.Module) -> None:
        _sample(policy, module, cal_prompts, cal_seeds, cal_steps, batch)

    modules, results = build_copies(policy, quantizers, calibrate, dev, log)
    t_prompts, t_seeds = [prompts[i % len(prompts)] for i in range(batch)], derive_seeds(BENCH_SEED + 1, batch)
    compiled = add_compiled(policy, modules, results, compile, lambda m, compiled: _sample(
        policy, m, t_prompts, t_seeds, steps, batch, compiled), log, quantizers)
    time_interleaved(policy, modules, results, t_prompts, t_seeds, steps, batch, repeats, dev, log)
    finish_compiled(policy, modules, results, compiled, compile, velocity_input(policy, t_prompts, t_seeds), dev)
    fidelity_note = None
    if spp >= 2:
        measure_fidelity(policy, modules, results, reward_fn, pool_prompts, pool_seeds, groups, fsteps, ref_steps,
                         batch, topk, batch_check, log)
    else:
        fidelity_note = ("fidelity not measured (seeds_per_prompt < 2)" if pipeline != "sd3-mid" else
                         "fidelity off: sd3-mid is random-init, its rewards are meaningless (speed only)")
    out = {
        "pipeline": pipeline, "model_path": model_path, "device": str(dev), "dtype": dtype,
        "settings": {"batch": batch, "steps": steps, "repeats": repeats, "prompts": len(prompts),
                     "compile": compile, "seeds_per_prompt": spp, "fidelity_steps": fsteps, "ref_steps": ref_steps,
                     "topk": topk, "reward": reward_name, "calibration_prompts": len(prompts),
                     "calibration_seeds_per_prompt": calibration_seeds, "guidance_scale": 1.0 if pipeline == "digits"
                     else getattr(policy, "guidance_scale", None)},
        "machine": machine_info(), "backends": results, "fidelity_note": fidelity_note,
    }
    if pipeline == "sd3-mid":
        out["model_parameters"] = sum(p.numel() for p in policy.transformer.parameters())
    return write_outputs(out, json_path, png_path, log, plot_precision)


def _batch_check(policy, module, reward_fn, prompts, seeds, steps, chunk, rewards, groups) -> dict:
    """Run the pool again with every sample among other batch-mates; compare rewards."""
    n = len(seeds)
    if n > chunk:
        order = torch.roll(torch.arange(n), max(1, chunk // 2))  # chunk boundaries move: new mates
        size = chunk
    else:
        order = torch.arange(n).flip(0)
        size = max(1, chunk // 2)
    r2 = _pool_rewards(policy, module, reward_fn, prompts, seeds, steps, size, order)
    finite = torch.isfinite(rewards) & torch.isfinite(r2)
    return {"max_abs_reward_change": float((rewards - r2)[finite].abs().max()) if finite.any() else float("nan"),
            "kendall_tau_grouped": ranking_fidelity(rewards, r2, groups)["kendall_tau"],
            "kendall_tau_pool": kendall_tau(rewards[finite], r2[finite]), "chunk": size}


__all__ = ["DEFAULTS", "PIPELINES", "SD3MidPolicy", "bench_precision", "build_copies",
           "build_quantizers", "default_backends", "format_table", "plot_precision", "sd3_mid_config"]
