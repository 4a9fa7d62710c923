"""Static activation ranges, calibrated once on real prompts, before any layer is swapped.

The real-kernel backends (``fp8``, ``nvfp4:kernel=scaled_mm``) calibrate on the full-precision
merged copy: forward pre-hooks on the ``nn.Linear`` layers to be quantized record each input's
absolute maximum while ``calibrate(copy)`` runs real prompts through it (as modelopt's ``"max"``
calibration does: full-precision activations). The ranges are then frozen into the quantized
layers, so a sample's output never depends on its batch-mates.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn


@torch.no_grad()
def record_input_amax(root: nn.Module, names: list[str], calibrate: Optional[Callable[[nn.Module], None]],
                      backend: str) -> dict[str, float]:
    """Run ``calibrate(root)`` and return ``{name: max |input|}`` of each listed submodule.

    Raises ValueError when ``calibrate`` is None or a listed layer saw no input (a calibrate
    callable that skips part of the model would leave that layer's scale undefined).
    """
    if calibrate is None:
        raise ValueError(f"{backend} calibrates its activation scales once: pass calibrate, a callable that runs "
                         f"real prompts through the module")
    amax: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(_module, args):
            a = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return hook

    handles = [root.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        calibrate(root)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in amax]
    if missing:
        raise ValueError(f"{len(missing)} of {len(names)} {backend} layers saw no calibration data (first: "
                         f"{missing[0]}); the calibrate callable must run real prompts through every quantized layer")
    values = torch.stack([amax[n] for n in names]).cpu().tolist()  # one host sync for all layers
    return dict(zip(names, values))
