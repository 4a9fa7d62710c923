"""Low-precision copies of a policy for exploration (Sol-RL, arXiv 2604.06916): one backend per file.

Every backend follows ``flowrl.types.Quantizer``: ``name``, ``available()``,
``quantize(module, calibrate) -> nn.Module`` (a private copy, LoRA merged; ``module`` is
never modified), plus ``unavailable_reason()`` (None, or why it cannot run here) and
``needs_calibration`` (whether ``calibrate`` is required: static activation scales).

==================  ==========================================================  =================
name                what                                                        where
==================  ==========================================================  =================
``none``            full-precision copy (control)                               anywhere
``int8-dynamic``    int8 weights, int8 activations per row or static (fbgemm)   CPU
``nvfp4-emulated``  NVFP4 numerics in pure torch (modelopt backend or torch)    anywhere, simulated
``nvfp4``           NVFP4: real FP4 GEMMs (``kernel=scaled_mm``, sm_100+), else   CUDA
                    modelopt fake quantization (``kernel=modelopt``, simulated)
``fp8``             FP8-E4M3 GEMMs, ``torch._scaled_mm`` (``kernel=scaled_mm``),  CUDA sm_89+
                    or modelopt fake quantization (``kernel=modelopt``)
==================  ==========================================================  =================

A quantized copy says what it really runs (:mod:`flowrl.quant.kernels`): ``real_kernels``
True only for real low-precision GEMMs; simulations (quantize-dequantize, CPU references of GPU
kernels) are labelled ``simulated`` wherever a benchmark reports them.

``get_quantizer(name, **options)`` builds one; ``available_backends()`` lists those that run
here; ``backend_status()`` says why the others do not. A backend spec string
``"name:key=value:key=value"`` (``parse_backend_spec``) carries options on a command line.
"""
from __future__ import annotations

from typing import Any, Optional

from ..registry import Registry
from .common import DEFAULT_SKIP, BackendUnavailable, merged_copy

QUANTIZERS = Registry("quantization backend", {
    "none": "flowrl.quant.none:NoQuantizer",
    "int8-dynamic": "flowrl.quant.int8:Int8DynamicQuantizer",
    "nvfp4-emulated": "flowrl.quant.nvfp4_emulated:NVFP4EmulatedQuantizer",
    "nvfp4": "flowrl.quant.nvfp4:NVFP4Quantizer",
    "fp8": "flowrl.quant.fp8:FP8Quantizer",
})


def backend_status() -> dict[str, Optional[str]]:
    """Every backend name -> None if it runs on this machine, else the reason it does not."""
    return {name: QUANTIZERS.get(name)().unavailable_reason() for name in QUANTIZERS.names()}


def available_backends() -> list[str]:
    """Names of the backends that run on this machine (default options)."""
    return [n for n, why in backend_status().items() if why is None]


def get_quantizer(name: str, *, require_available: bool = True, **options: Any):
    """Build backend ``name`` with ``options`` (its dataclass fields).

    Unknown names raise ValueError listing the valid ones; with ``require_available`` a
    backend that cannot run here raises :class:`BackendUnavailable` (a ValueError) that says
    why and names the backends that do work on this machine.
    """
    cls = QUANTIZERS.get(name)
    try:
        q = cls(**options)
    except TypeError as e:
        import dataclasses

        valid = [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []
        raise ValueError(f"bad options {sorted(options)} for quantization backend {name!r} ({e}); "
                         f"valid options: {', '.join(valid) or 'none'}") from None
    if require_available:
        check_available(q)
    return q


def check_available(q) -> None:
    """Raise :class:`BackendUnavailable` naming the reason and the backends that work here."""
    why = q.unavailable_reason()
    if why is not None:
        ok = [n for n in available_backends() if n != q.name]
        raise BackendUnavailable(f"quantization backend {q.name!r} is not available here: {why}. "
                                 f"Backends that work on this machine: {', '.join(ok)}")


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_backend_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"int8-dynamic:activation=per_tensor"`` -> ``("int8-dynamic", {"activation": "per_tensor"})``."""
    name, *parts = spec.strip().split(":")
    opts: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"backend option {part!r} in {spec!r} must look like key=value, "
                             f"e.g. int8-dynamic:activation=per_tensor")
        opts[key.strip()] = _parse_value(value.strip())
    return name.strip(), opts


__all__ = ["QUANTIZERS", "BackendUnavailable", "DEFAULT_SKIP", "available_backends", "backend_status",
           "get_quantizer", "merged_copy", "parse_backend_spec"]
