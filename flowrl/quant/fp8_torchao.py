"""``fp8:kernel=torchao``: torchao's row-wise dynamic float8 on the exploration copy.

torchao's ``Float8DynamicActivationFloat8WeightConfig`` with per-row granularity (torchao 0.18, flowrl's
``quant`` extra; its wiring tested on the CPU, where torchao's float8 refuses to run): each weight quantized
once to E4M3 with one scale per output row, each input quantized per row (token) at every call (dynamic: no
calibration, a sample never depends on its batch-mates), one ``torch._scaled_mm`` per layer. Under ``torch.compile``
(``model.compile``) the input quantization fuses into the kernel that produces the input, which the
hand-written kernel (``kernel=scaled_mm``: eager quantization passes, static scales) cannot do.

Which layers: every ``nn.Linear`` outside the skip-list (the layers ``kernel=scaled_mm`` keeps in full
precision: embedders, the output layers), except those whose in or out features are not a multiple of 16
(torchao's own rule: it would leave them unquantized silently; here they are left out and counted).
``set_inductor_config`` is off: torchao would otherwise change inductor's global settings, and a benchmark
would then compile bf16 and FP8 differently.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import nn

from .common import is_skipped

ALIGN = 16  # torchao's float8 GEMMs need K and N multiples of 16 (torchao's _fp8_mm_compat)
INSTALL_HINT = "pip install 'torchao>=0.18' (flowrl's quant extra: pip install -e '.[quant]')"


def torchao_problem() -> Optional[str]:
    """None if torchao's float8 can run here (checked without importing torchao), else why not."""
    if importlib.util.find_spec("torchao") is None:
        return f"fp8:kernel=torchao needs torchao, which is not installed ({INSTALL_HINT})"
    if not torch.cuda.is_available():
        return ("fp8:kernel=torchao runs torchao's float8 GEMMs on a CUDA GPU (sm_89+: Ada, Hopper, Blackwell), and "
                "torchao refuses them elsewhere (torch.cuda.is_available() is False); on this machine use "
                "'fp8:simulate_on_cpu=true' (FP8 numerics) or 'int8-dynamic' (real int8 kernels)")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return (f"fp8:kernel=torchao needs an sm_89+ GPU (Ada, Hopper, Blackwell); this one is sm_{cap[0]}{cap[1]} "
                f"({torch.cuda.get_device_name()}): use 'fp8:kernel=modelopt' (simulated) or 'nvfp4-emulated'")
    return None


def torchao_layers(module: nn.Module, skip: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(quantized, left out): the ``nn.Linear`` layers of ``module`` outside ``skip``, split by whether both
    feature counts are multiples of 16 (torchao's float8 GEMMs run only those)."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and not is_skipped(n, skip)]
    fits = [n for n in names if module.get_submodule(n).in_features % ALIGN == 0
            and module.get_submodule(n).out_features % ALIGN == 0]
    return fits, [n for n in names if n not in fits]


def torchao_config(weight: str, fast_accum: bool):
    """torchao's config: row-wise scales (``weight`` ``auto`` / ``per_channel``; ``per_tensor``: one scale each),
    ``use_fast_accum`` as given, torchao's inductor settings left alone."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    granularity = PerTensor() if weight == "per_tensor" else PerRow()
    return Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False,
                                                    mm_config=Float8MMConfig(use_fast_accum=bool(fast_accum)))


def check_torchao_module(module: nn.Module, weight: str) -> None:
    """A ValueError unless ``module`` sits on a CUDA device, in bfloat16 for row-wise scales (torchao's rule)."""
    p = next(module.parameters())
    if p.device.type != "cuda":
        raise ValueError(f"fp8:kernel=torchao quantizes a model on a CUDA device; this one is on {p.device}")
    if weight != "per_tensor" and p.dtype != torch.bfloat16:
        raise ValueError(f"fp8:kernel=torchao's row-wise scales need a bfloat16 model (torchao's rule), this one is "
                         f"{str(p.dtype).replace('torch.', '')}: set model.options.dtype=bfloat16, or use "
                         f"fp8:kernel=torchao:weight=per_tensor")


def quantize_torchao(copy: nn.Module, skip: tuple[str, ...], weight: str, fast_accum: bool) -> tuple[int, int]:
    """Quantize ``copy`` (a private merged copy) in place -> (layers quantized, layers left in full precision
    for their shape)."""
    from torchao.quantization import quantize_

    fits, left = torchao_layers(copy, skip)
    if not fits:
        raise ValueError(f"fp8:kernel=torchao found no nn.Linear outside the skip-list {skip} with in and out "
                         f"features multiples of {ALIGN}; nothing to quantize")
    chosen = set(fits)
    quantize_(copy, torchao_config(weight, fast_accum), filter_fn=lambda m, name: name in chosen)
    return len(fits), len(left)
