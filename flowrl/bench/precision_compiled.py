"""Eager and compiled side by side in ``flowrl bench precision --compile MODE``: what the JSON's
``backends.<spec>.compiled`` entry holds, and the fixed input of the velocity check.

Each backend is measured eagerly (its usual fields), then compiled as ``model.compile`` compiles a rollout
(:func:`flowrl.utils.compile.compile_rollouts`: the no-gradient forward, ``dynamic=False``). Its entry:

* ``mode``, ``backend`` (dynamo's: ``inductor`` unless ``FLOWRL_COMPILE_BACKEND`` says otherwise),
  ``compiles`` / ``recompiles`` / ``compile_seconds`` over the whole measurement (a new resolution or batch
  is one recompile: shapes are static);
* per measured size (``resolutions.<px>`` of an architecture; the digits / ``sd3-mid`` / ``sd3`` / ``flux``
  benchmark measures one size and keeps these fields in the entry itself): the eager
  row's fields (``images_per_second``, ``forward_ms``, ``peak_mb``, ``velocity_rel_error`` against full
  precision, eager), ``velocity_rel_error_vs_eager`` (the compile's own change), ``compile_seconds`` (the
  warm-up calls that compiled), ``recompiles_timed`` (compiles during the timed runs, after that warm-up: 0
  when the compiled graph is reused), and the speed-ups ``speedup_vs_eager`` (this backend eager),
  ``speedup_vs_full`` (full precision eager) and ``speedup_vs_full_compiled`` (full precision compiled; the
  ``forward_`` versions of the three for the bare forward).
"""
from __future__ import annotations

import statistics
from typing import Iterable, Optional

import torch

from ..types import swapped_transformer
from ..utils.compile import CompileLog, compile_backend, compile_rollouts, eager_forwards
from .precision_measure import timed


def velocity_input(policy, prompts: list[str], seeds: list[int], sigma: float = 0.75):
    """(x ``[B, *latent_shape]``, sigma ``[B]``, conditioning): one fixed input of ``policy.velocity``."""
    x = policy.initial_noise(list(seeds))  # [B, C, h, w]
    s = torch.tensor(float(sigma), device=x.device)  # []: a sampler's step passes one sigma (expanded to [B])
    return x, s, policy.encode_prompts(list(prompts))


def compiled_entry(mode: str, log: CompileLog, rows: dict) -> dict:
    """``backends.<spec>.compiled`` (module doc) from the compiled rows by size and the backend's compile log."""
    return {"mode": mode, "backend": compile_backend(), "compiles": log.compiles, "recompiles": log.recompiles,
            "compile_seconds": log.compile_seconds, "resolutions": rows}


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _row(r: dict, size: Optional[str]) -> dict:
    return r if size is None else r.get("resolutions", {}).get(size, {})


def compiled_speedups(results: dict, sizes: Iterable[Optional[str]] = (None,)) -> None:
    """Fill each compiled row's speed-ups (module doc) from the eager rows (seconds per batch and forward ms)
    at each size (``resolutions.<size>``; None: the one row kept in the entry); backends without a compiled
    entry are left alone."""
    full = results["full"]
    for r in results.values():
        if "compiled" not in r:
            continue
        for size in sizes:
            row, eager = _row(r["compiled"], size), _row(r, size)
            fe, fc = _row(full, size), _row(full.get("compiled", {}), size)
            for key, t in (("", "seconds_per_batch"), ("forward_", "forward_ms")):
                row[f"{key}speedup_vs_eager"] = _ratio(eager.get(t), row.get(t))
                row[f"{key}speedup_vs_full"] = _ratio(fe.get(t), row.get(t))
                row[f"{key}speedup_vs_full_compiled"] = _ratio(fc.get(t), row.get(t))


# ---------------------------------------------------------------- the one-size benchmark (digits, sd3-mid, sd3, flux)
def add_compiled(policy, modules: dict, results: dict, mode: str, sample, log, quantizers: dict) -> dict:
    """Compile every backend's module in place (role: its spec), compile it by one sampling call
    (``sample(module, compiled=True)``), and add ``"<backend> compiled"`` to ``modules`` and ``results`` for the
    interleaved timing -> ``spec -> (log, compiles after that call)``; nothing when ``mode`` is ``off``. A backend
    whose quantizer declares ``compilable = False`` (as ``model.compile`` leaves it eager) is said and skipped."""
    out = {}
    if mode == "off":
        return out
    for spec in list(modules):
        if not getattr(quantizers.get(spec), "compilable", True):
            log(f"[bench precision] {results[spec]['label']}: not compiled (its kernels cannot be traced; "
                f"model.compile leaves its copy eager)", flush=True)
            continue
        clog = compile_rollouts(modules[spec], mode, role=spec)
        sample(modules[spec], compiled=True)
        out[spec] = (clog, clog.compiles + clog.recompiles)
        log(f"[bench precision] {results[spec]['label']} compiled ({mode}, {compile_backend()}): "
            f"{clog.compile_seconds:.1f}s to compile", flush=True)
        modules[f"{spec} compiled"] = modules[spec]
        results[f"{spec} compiled"] = {"label": f"{results[spec]['label']} compiled"}
    return out


def _forward(policy, module, inputs, compiled: bool, device, repeats: int = 5) -> tuple[float, torch.Tensor]:
    """(median ms of ``repeats`` bare forwards after one warm-up, velocity ``[B, ...]`` float32 on the CPU)."""
    x, sigma, cond = inputs
    with torch.no_grad(), swapped_transformer(policy, module), \
            eager_forwards(not compiled):
        policy.velocity(x, sigma, cond)
        ms = [1000.0 * timed(lambda: policy.velocity(x, sigma, cond), device) for _ in range(repeats)]
        return statistics.median(ms), policy.velocity(x, sigma, cond).float().cpu()


def finish_compiled(policy, modules: dict, results: dict, compiled: dict, mode: str, inputs, device) -> None:
    """After the interleaved timing: every backend's bare forward and velocity eager and compiled (``inputs``:
    :func:`velocity_input`), each ``"<backend> compiled"`` result folded into ``results[<backend>]["compiled"]``, the
    speed-ups filled, and the compiled forwards removed (what follows runs eagerly)."""
    if not compiled:
        return
    velocity = {}
    for spec in compiled:
        for c in (False, True):
            ms, velocity[spec, c] = _forward(policy, modules[spec], inputs, c, device)
            (results[f"{spec} compiled"] if c else results[spec])["forward_ms"] = ms
    ref = velocity["full", False]
    for spec, (clog, warm) in compiled.items():
        row = results.pop(f"{spec} compiled")
        modules.pop(f"{spec} compiled")
        compile_rollouts(modules[spec], "off")
        results[spec]["velocity_rel_error"] = rel_error(velocity[spec, False], ref)
        row.update({"velocity_rel_error": rel_error(velocity[spec, True], ref), "recompiles_timed":
                    clog.compiles + clog.recompiles - warm,
                    "velocity_rel_error_vs_eager": rel_error(velocity[spec, True], velocity[spec, False])})
        row.pop("speedup_vs_full_best", None)
        results[spec]["compiled"] = {**compiled_entry(mode, clog, {}), **row}
        results[spec]["compiled"].pop("resolutions")
    compiled_speedups(results)


def rel_error(v: torch.Tensor, ref: torch.Tensor) -> float:
    """``||v - ref|| / ||ref||`` (Frobenius norms over every element; ``ref``'s norm floored at 1e-12)."""
    return float((v - ref).norm() / ref.norm().clamp_min(1e-12))
