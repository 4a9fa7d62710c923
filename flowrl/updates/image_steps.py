"""What the sampler-free updates on an image dataset share (``sft``: :mod:`flowrl.updates.sft`, ``dpo_offline``:
:mod:`flowrl.updates.dpo_offline`): the training-time options, the optimizer step's passes, the images turned
into latents, and each pass's ``(t, eps)``.

One call is one optimizer step over ``train.grad_accum`` passes of ``offline.batch_groups`` rows of
``data.dataset`` (images, or pairs), as the offline trainer draws them; each pass's ``(t, eps)`` come from
``(train.seed, step, pass, rank)`` only (seed purpose ``offline.noise``), so a resumed run continues exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .base import Batch, Update, UpdateOptions, check_number
from .offline_gdro import check_times, pass_noise, step_batch


@dataclass
class ImageStepOptions(UpdateOptions):
    """The training times of a pass: ``t_sampling`` 'logit_normal' (SD3's and the digits base's pretraining:
    sigmoid of N(t_mean, t_std)) or 'uniform' on [t_min, t_max], clipped to [t_min, t_max]."""

    t_sampling: str = "logit_normal"  # 'logit_normal' or 'uniform'
    t_min: float = 0.001  # smallest t (sigma; 0 = clean)
    t_max: float = 0.999  # largest t
    t_mean: float = 0.0   # logit-normal location
    t_std: float = 1.0    # logit-normal scale

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "t_std", strict=True)
        check_number(self, "t_mean", minimum=-float("inf"))
        for name in ("t_min", "t_max"):
            check_number(self, name)
        check_times(self)


def encode_images(policy, images: torch.Tensor) -> torch.Tensor:
    """Latents ``x0`` of ``images`` ``[n, 3, H, W]`` in [0, 1] by the policy's ``encode`` (float32, no gradient);
    a clear error for a model without one."""
    why = ("training on an image dataset (train.loss sft / dpo_offline) needs the model's encode(images) -> latents; "
           "the digits model and the diffusers image adapters that decode with their VAE alone (sd3, flux, sana, ...) "
           "have one")
    encode = getattr(policy, "encode", None)
    if encode is None:
        raise ConfigError(f"{type(policy).__name__} has no encode(images): {why}")
    try:
        with torch.no_grad():
            return encode(images.to(getattr(policy, "device", images.device))).float()
    except NotImplementedError as e:
        raise ConfigError(f"{e}: {why}") from None


class ImageStepUpdate(Update):
    """Base of the updates on ``data.dataset``: the step's passes in the trainer's order, and their noise."""

    def batch(self, passes: list, step: int) -> Batch:
        return step_batch(passes, step)

    def noise(self, step: int, micro: int, n: int, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t [n], eps [n, *shape])`` of pass ``micro`` of ``step`` on this process, float32 on the device."""
        t, eps = pass_noise(self.ctx, self.opts, step, micro, n, shape)  # [n], [n, C, H, W]
        return t.to(self.ctx.device), eps.to(self.ctx.device)
