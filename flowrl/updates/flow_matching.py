"""What the updates that train the flow-matching loss on finished samples share (AWM ``awm.py``, DGPO
``dgpo.py``; docs/algorithms.md §11-12): their common options (training times, clip ranges, advantage
normalisation, the KL weight, the ramped decay of their EMA copy), the inputs ``x_t`` and target
``v* = eps - x0`` of a training time, and the EMA copy itself (their group advantages:
:func:`flowrl.updates.rewards.sample_advantages`).

The loss math is :mod:`flowrl.losses.flow_matching`, :mod:`flowrl.losses.awm` and :mod:`flowrl.losses.dgpo`;
this module only turns options and rollouts into their arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Union

import torch

from ..errors import ConfigError
from ..losses.flow_matching import TIME_SAMPLINGS, TimeSampling, clip_pair, ramped_decay, sample_times
from ..seeding import stream_seed
from ..sde import flow_interpolate
from ..trainable import EMA
from .base import UpdateOptions, check_number

EMA_MAX_DECAY, EMA_RAMP = 0.3, 0.001  # the EMA copies' decay min(0.3, 0.001 step): AWM's and DGPO's code


@dataclass
class MatchingOptions(UpdateOptions):
    """``train.loss_options`` shared by the updates on finished samples with the flow-matching loss."""

    time_sampling: str = "discrete"  # how training times are drawn: logit_normal, uniform, discrete,
    #                                  discrete_with_init or discrete_wo_init (docs/algorithms.md §11)
    num_times: int = 4  # training times per epoch, shared by every sample of the call
    time_range: Union[float, list] = 0.9  # the fraction of the denoising axis times come from (0 = pure noise,
    #                                       1 = clean): f means [0, f], or [lo, hi]; 0.9 keeps sigma >= 0.1
    time_shift: float = 3.0  # shift m of the continuous kinds, m u / (1 + (m - 1) u) (1: none)
    logit_mean: float = 0.0  # logit_normal: mean of the normal before the sigmoid
    logit_std: float = 1.0   # logit_normal: its std
    clip_range: Union[float, list] = 1e-4  # ratio clip as offsets from 1: c means [1 - c, 1 + c], or [lo, hi]
    adv_clip: Union[float, list] = 5.0  # advantage clip: c means [-c, c], or [lo, hi]
    global_std: bool = False  # divide advantages by the std of the whole batch (every process) instead of the group's
    beta_kl: float = 0.0  # weight of mean((v_theta - v_ref)^2) to the frozen reference model
    ema_max_decay: Optional[float] = None  # the EMA copy's decay min(ema_max_decay, ema_ramp * step); empty: 0.3
    ema_ramp: Optional[float] = None  # empty: 0.001 (AWM's Flow-Factory SD3.5-M recipe: 0.0003)

    def __post_init__(self):
        super().__post_init__()
        if self.time_sampling not in TIME_SAMPLINGS:
            raise ValueError(f"train.loss_options.time_sampling must be one of {', '.join(TIME_SAMPLINGS)}, "
                             f"got {self.time_sampling!r}")
        if isinstance(self.num_times, bool) or not isinstance(self.num_times, int) or self.num_times < 1:
            raise ValueError(f"train.loss_options.num_times must be a positive integer, got {self.num_times!r}")
        check_number(self, "time_shift", strict=True)
        check_number(self, "logit_std", strict=True)
        check_number(self, "logit_mean", minimum=-float("inf"))
        check_number(self, "beta_kl")
        if not isinstance(self.global_std, bool):
            raise ValueError(f"train.loss_options.global_std must be true or false, got {self.global_std!r}")
        for name in ("clip_range", "adv_clip"):
            _checked(clip_pair, getattr(self, name), f"train.loss_options.{name}")
        if self.ema_max_decay is not None and not (isinstance(self.ema_max_decay, (int, float))
                                                   and 0 <= self.ema_max_decay < 1):
            raise ValueError(f"train.loss_options.ema_max_decay must be in [0, 1), got {self.ema_max_decay!r}")
        if self.ema_ramp is not None:
            check_number(self, "ema_ramp")
        self.times()  # the range and kind, checked now

    def times(self) -> TimeSampling:
        """The :class:`~flowrl.losses.flow_matching.TimeSampling` these options describe."""
        fraction = list(self.time_range) if isinstance(self.time_range, (list, tuple)) else self.time_range
        return _checked(TimeSampling, kind=self.time_sampling, num=self.num_times, fraction=fraction,
                        shift=self.time_shift, logit_mean=self.logit_mean, logit_std=self.logit_std,
                        where="train.loss_options.time_range")

    def ema_options_given(self) -> list[str]:
        """The EMA options set (an error where the update keeps no EMA copy)."""
        return [k for k in ("ema_max_decay", "ema_ramp") if getattr(self, k) is not None]

    def ema_copy(self, module: torch.nn.Module) -> "RampedCopy":
        """A new EMA copy of ``module``'s trained tensors with these options' decay."""
        return RampedCopy(module, EMA_MAX_DECAY if self.ema_max_decay is None else self.ema_max_decay,
                          EMA_RAMP if self.ema_ramp is None else self.ema_ramp)


def _checked(fn, *args, where: str = "", **kwargs):
    """``fn(*args, **kwargs)``, a loss module's :class:`ConfigError` re-raised naming the option ``where``
    (unless it names one already, as ``clip_pair``'s does)."""
    try:
        return fn(*args, **kwargs)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("train.loss_options") else f"{where}: {msg}") from None


class RampedCopy(EMA):
    """A copy of the trained tensors moved as ``copy <- d copy + (1 - d) theta`` with the ramped decay
    ``d = min(max_decay, ramp * step)`` (:func:`flowrl.losses.flow_matching.ramped_decay`): AWM's EMA for
    the KL and off-policy sampling, DGPO's EMA old policy. Made equal to the weights (decay 0 at step 0)."""

    def __init__(self, module: torch.nn.Module, max_decay: float, ramp: float):
        super().__init__(module, decay=0.0)
        self.max_decay, self.ramp = float(max_decay), float(ramp)

    def decay_at(self, step: int) -> float:
        return ramped_decay(step, self.max_decay, self.ramp)

    def step(self, module: torch.nn.Module, step: int) -> float:
        """Move towards ``module``'s tensors with the decay of ``step``; returns that decay."""
        d = self.decay_at(step)
        self.update(module, d)
        return d


class KeepsRampedCopy:
    """Mixin of an update keeping one :class:`RampedCopy` (``self.ramped``; AWM's EMA, DGPO's old policy):
    made on first use by :meth:`ramped_copy` with the options' decay, checkpointed under ``COPY`` (its
    name in ``Needs.copies``) and restored from a checkpoint's extra tensors. Listed before ``Update``."""

    COPY: ClassVar[str] = ""
    ramped: Optional[RampedCopy] = None

    def ramped_copy(self) -> RampedCopy:
        if self.ramped is None:
            self.ramped = self.opts.ema_copy(self.ctx.unwrapped)
        return self.ramped

    def state_dict(self) -> dict:
        return {self.COPY: self.ramped.shadow} if self.ramped is not None else {}

    def load_state_dict(self, extra: dict) -> None:
        if self.COPY in extra:
            self.ramped_copy().shadow = extra[self.COPY]


def training_times(opts: MatchingOptions, rollout, generator: torch.Generator) -> torch.Tensor:
    """``[num_times]`` float32 sigmas drawn by ``opts`` (the discrete kinds among the rollout's sampling
    steps, ``Rollout.sigmas`` without its final 0); an error naming the option when none fits."""
    try:
        return sample_times(opts.times(), rollout.sigmas[:-1].float().cpu(), generator)
    except ValueError as e:
        raise ConfigError(f"train.loss_options.time_range / time_sampling: {e} (the sampler's {len(rollout.sigmas) - 1} "
                          f"steps)") from None


def draw_generator(seed: int, iteration: int, epoch: int) -> torch.Generator:
    """The generator of an update's draws made in ``batch()`` for ``epoch`` (seed purpose ``update.draws``)."""
    return torch.Generator().manual_seed(stream_seed("update.draws", seed, iteration, epoch))


def noised(x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, v*)``: ``x_t = (1 - sigma) x0 + sigma eps`` and the target ``eps - x0`` for ``x0``, ``eps``
    ``[B, C, (F,) H, W]`` and ``sigma`` ``[B]``."""
    s = sigma.to(x0.dtype).view(-1, *[1] * (x0.dim() - 1))  # [B, 1, ..., 1]
    return flow_interpolate(x0, eps, s), eps - x0
