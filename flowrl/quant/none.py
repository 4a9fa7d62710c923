"""``none``: a full-precision private copy (LoRA merged): the control that isolates Sol-RL's
selection from quantization error, and the reference of the regeneration-equality test."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

from torch import nn

from .common import merged_copy


@dataclass
class NoQuantizer:
    """Identity backend: ``quantize`` returns :func:`merged_copy` of the module, nothing else."""

    name: ClassVar[str] = "none"
    needs_calibration: ClassVar[bool] = False
    syncs_in_place: ClassVar[bool] = True  # a copy's state is its parameters and buffers

    def unavailable_reason(self) -> Optional[str]:
        return None

    def available(self) -> bool:
        return True

    def quantize(self, module: nn.Module, calibrate: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
        return merged_copy(module)
