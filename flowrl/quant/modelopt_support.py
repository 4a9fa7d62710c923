"""nvidia-modelopt, imported lazily: availability, Linear-only configs with the skip-list, quantize.

``mtq.quantize(model, config, forward_loop)`` (modelopt.torch.quantization) swaps modules for
quantized ones in place and runs ``forward_loop(model)`` to calibrate (``"max"``: per-tensor
absolute maxima, static). flowrl always quantizes a private :func:`merged_copy`.
Tested with nvidia-modelopt 0.47 (the list form of ``quant_cfg``).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import warnings
from typing import Any, Callable, ClassVar, Optional

from torch import nn

from .common import merged_copy

INSTALL_HINT = "pip install nvidia-modelopt (not nvidia-modelopt[hf], which pins other transformers versions)"


def modelopt_problem() -> Optional[str]:
    """None if ``modelopt.torch.quantization`` can be imported (checked without importing it)."""
    if importlib.util.find_spec("modelopt") is None:
        return f"nvidia-modelopt is not installed ({INSTALL_HINT})"
    return None


def import_mtq():
    """``modelopt.torch.quantization``, its import-time warnings silenced (slow: ~5-15 s): among them
    torch's ``No CUDA runtime is found`` log line, which its import of ``torch.utils.cpp_extension``
    prints on every machine without a GPU."""
    problem = modelopt_problem()
    if problem:
        raise ImportError(problem)
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_log.level
    cpp_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import modelopt.torch.quantization as mtq
    finally:
        cpp_log.setLevel(level)
    return mtq


def preset_attributes(preset: str, quantizer: str = "*weight_quantizer") -> dict[str, Any]:
    """The quantizer attributes of ``quantizer`` in modelopt's preset config ``preset``
    (e.g. ``"NVFP4_DEFAULT_CFG"``), whichever form (list or dict) the installed version uses."""
    cfg = getattr(import_mtq(), preset)["quant_cfg"]
    if isinstance(cfg, dict):
        return dict(cfg[quantizer])
    for entry in cfg:
        if entry.get("quantizer_name") == quantizer and "cfg" in entry:
            return copy.deepcopy(dict(entry["cfg"]))
    raise KeyError(f"modelopt preset {preset} has no {quantizer!r} entry")


def linear_only_config(weight: dict[str, Any], inputs: dict[str, Any], skip: tuple[str, ...],
                       algorithm: str = "max") -> dict[str, Any]:
    """A config quantizing the weights and inputs of ``nn.Linear`` layers only (not norms, convs or
    attention matmuls), with the modules matched by ``skip`` left in full precision."""
    entries: list[dict[str, Any]] = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "parent_class": "nn.Linear", "cfg": dict(weight)},
        {"quantizer_name": "*input_quantizer", "parent_class": "nn.Linear", "cfg": dict(inputs)},
    ]
    entries += [{"quantizer_name": p if p.endswith("*") else p + ".*", "enable": False} for p in skip]
    return {"quant_cfg": entries, "algorithm": algorithm}


def mtq_quantize(module: nn.Module, config: dict[str, Any], calibrate: Callable[[nn.Module], None]) -> nn.Module:
    """``mtq.quantize`` on a private merged copy of ``module``; modelopt's prints are swallowed.

    Raises if no quantizer ended up enabled or an enabled input quantizer saw no calibration data.
    """
    mtq = import_mtq()
    q = merged_copy(module)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(q, config, forward_loop=calibrate)
    enabled = [(n, m) for n, m in q.named_modules() if n.endswith("_quantizer") and getattr(m, "is_enabled", False)]
    if not enabled:
        raise ValueError("modelopt enabled no quantizer: every nn.Linear is on the skip-list; nothing to quantize")
    missing = [n for n, m in enabled if n.endswith("input_quantizer") and getattr(m, "amax", None) is None]
    if missing:
        raise ValueError(f"{len(missing)} input quantizers saw no calibration data (first: {missing[0]}); the "
                         f"calibrate callable must run real prompts through every quantized layer")
    return q


class ModeloptPreset:
    """The body the modelopt backends (``fp8``, ``nvfp4``) share: a preset's quantizer attributes on
    the weights and inputs of ``nn.Linear`` layers outside the skip-list, activation scales
    calibrated once (static). Subclasses are dataclasses with a ``skip`` field and set ``name``,
    ``PRESET``, :meth:`unavailable_reason` and, if needed, :meth:`check_module`."""

    PRESET: ClassVar[str] = ""
    name: ClassVar[str] = ""
    needs_calibration: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.skip = tuple(self.skip)

    def unavailable_reason(self) -> Optional[str]:
        raise NotImplementedError

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def check_module(self, module: nn.Module) -> None:
        """Raise if ``module`` cannot be quantized by this backend (default: anything goes)."""

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]]) -> nn.Module:
        problem = self.unavailable_reason()
        if problem:
            raise RuntimeError(problem)
        if calibrate is None:
            raise ValueError(f"{self.name} calibrates its activation scales once: pass calibrate, a callable that "
                             f"runs real prompts through the module")
        self.check_module(module)
        return mtq_quantize(module, self.config(), calibrate)

    def config(self) -> dict:
        """The modelopt config: ``PRESET``'s attributes on Linear weights and inputs, the skip-list disabled."""
        weight = preset_attributes(self.PRESET, "*weight_quantizer")
        inputs = preset_attributes(self.PRESET, "*input_quantizer")
        return linear_only_config(weight, inputs, self.skip)
