"""Pieces shared by the losses that train on finished samples through the flow-matching loss
(AWM, DGPO; docs/algorithms.md §11-12): training-time sampling, clip ranges, the per-sample
velocity error, the ramped EMA decay of their "old" copies.

Times are returned as **sigma** in ``[0, 1]`` (``x_t = (1 - sigma) x0 + sigma eps``, flowrl's
convention). The peers (Flow-Factory ``utils/noise_schedule.py``, commit a0b2bc5) work on the
scheduler's 0..1000 scale and divide by 1000; flowrl does the same arithmetic on that scale
internally so its draws equal theirs for the same generator, then returns ``t / 1000``.

A time range is a *fraction along the denoising axis*, as Flow-Factory's ``timestep_range``:
fraction 0 is sigma 1 (pure noise), fraction 1 is sigma 0 (clean), and ``(lo, hi)`` keeps the
times ``1000 (1 - hi) <= t <= 1000 (1 - lo)``. A single float ``f`` means ``(0, f)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..errors import ConfigError

TIMESTEP_MAX = 1000.0  # the scheduler scale the peers sample on (diffusers' num_train_timesteps)
TIME_SAMPLINGS = ("logit_normal", "uniform", "discrete", "discrete_with_init", "discrete_wo_init")
# discrete kinds -> (include the first valid step in the strata, always train the first valid step)
_DISCRETE = {"discrete": (True, False), "discrete_with_init": (True, True), "discrete_wo_init": (False, False)}


def _fraction_range(value: Union[float, tuple, list]) -> tuple[float, float]:
    lo, hi = (0.0, float(value)) if not isinstance(value, (tuple, list)) else (float(value[0]), float(value[1]))
    if not 0.0 <= lo < hi <= 1.0:
        raise ConfigError(f"time range must satisfy 0 <= lo < hi <= 1 (a fraction along the denoising axis, "
                          f"0 = pure noise), got {(lo, hi)}; e.g. 0.9 or [0.0, 0.9]")
    return lo, hi


@dataclass(frozen=True)
class TimeSampling:
    """How the training times of one batch are drawn (Flow-Factory's ``time_sampling_strategy``).

    * ``logit_normal``: stratified logit-normal ``sigmoid(N(logit_mean, logit_std))``, warped by
      ``shift`` (``m s / (1 + (m - 1) s)``) and clamped to ``[0.01, 1 - 1e-6]``, read as a fraction
      along the denoising axis inside ``fraction``.
    * ``uniform``: stratified uniform fractions inside ``fraction``, warped by ``shift`` if != 1.
    * ``discrete``, ``discrete_with_init``, ``discrete_wo_init``: stratified draws of the sampling
      schedule's own steps whose time lies inside ``fraction``; ``_with_init`` always includes the
      first (noisiest) such step, ``_wo_init`` never does.

    ``num`` times per call (``num_train_timesteps``); every sample of the batch shares them.
    """

    kind: str = "discrete"
    num: int = 4
    fraction: Union[float, tuple] = 0.9
    shift: float = 3.0
    logit_mean: float = 0.0
    logit_std: float = 1.0

    def __post_init__(self):
        if self.kind not in TIME_SAMPLINGS:
            raise ConfigError(f"unknown time sampling {self.kind!r}; choose one of {TIME_SAMPLINGS}")
        if not (isinstance(self.num, int) and self.num >= 1):
            raise ConfigError(f"time sampling num must be a positive integer, got {self.num!r}")
        if not self.shift > 0:
            raise ConfigError(f"time sampling shift must be > 0 (1 = no shift), got {self.shift!r}")
        if not self.logit_std > 0:
            raise ConfigError(f"time sampling logit_std must be > 0, got {self.logit_std!r}")
        object.__setattr__(self, "fraction", _fraction_range(self.fraction))


def sample_times(opts: TimeSampling, step_sigmas: Optional[torch.Tensor] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw ``opts.num`` training times -> ``[num]`` float32 sigmas in ``[0, 1]``.

    ``step_sigmas``: ``[T]`` sigma at which each sampling step starts (a flowrl schedule without
    its final 0); required by the discrete kinds. The random calls and their order equal
    Flow-Factory's ``TimeSampler`` (a0b2bc5), so one seeded ``generator`` gives the same times.
    """
    lo, hi = opts.fraction
    if opts.kind in _DISCRETE:
        if step_sigmas is None:
            raise ValueError(f"time sampling {opts.kind!r} draws from the sampling schedule: pass step_sigmas [T]")
        t = _discrete(opts, step_sigmas.float() * TIMESTEP_MAX, generator)  # [num], 0..1000
    else:
        if opts.kind == "logit_normal":
            frac = lo + _logit_normal_unit(opts, generator) * (hi - lo)  # [num]
        else:
            u = torch.rand(opts.num, generator=generator)
            f = lo + (torch.arange(opts.num) + u) / opts.num * (hi - lo)  # [num], one per stratum
            frac = f[torch.randperm(opts.num, generator=generator)]
            if abs(opts.shift - 1.0) > 1e-6:
                frac = opts.shift * frac / (1 + (opts.shift - 1) * frac)
        t = TIMESTEP_MAX * (1.0 - frac)  # [num]
    return (t / TIMESTEP_MAX).clamp(0.0, 1.0).float()


def _logit_normal_unit(opts: TimeSampling, generator) -> torch.Tensor:
    """Stratified logit-normal draws in (0, 1), shifted and clamped -> [num] (AWM arXiv 2509.25050)."""
    n = opts.num
    base = (torch.arange(n) + torch.rand(n, generator=generator)) / n  # [n], one per stratum
    z = torch.distributions.Normal(0.0, 1.0).icdf(base.clamp(1e-7, 1 - 1e-7))
    z = z[torch.randperm(n, generator=generator)]
    raw = torch.sigmoid(z * opts.logit_std + opts.logit_mean)
    raw = opts.shift * raw / (1 + (opts.shift - 1) * raw)
    return raw.clamp(min=0.01, max=1.0 - 1e-6)


def _discrete(opts: TimeSampling, ts: torch.Tensor, generator) -> torch.Tensor:
    """Stratified step draws from the schedule's times ``ts`` [T] (0..1000 scale) -> [num]."""
    lo, hi = opts.fraction
    t_min, t_max = TIMESTEP_MAX * (1.0 - hi), TIMESTEP_MAX * (1.0 - lo)
    valid = torch.where((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
    if valid.numel() == 0:
        raise ValueError(f"no sampling step has its time inside the fraction range {opts.fraction}")
    first, last = int(valid.min()), int(valid.max())
    include_init, force_init = _DISCRETE[opts.kind]
    if (force_init and opts.num > 1 or not include_init) and last <= first:
        raise ValueError(f"time sampling {opts.kind!r}: the fraction range {opts.fraction} keeps only step {first}, "
                         "none after it; widen the range or use 'discrete'")
    if force_init and opts.num == 1:
        idx = torch.tensor([first])
    elif force_init:
        idx = torch.cat([torch.tensor([first]), _stratified(opts.num - 1, first + 1, last, generator)])
    else:
        idx = _stratified(opts.num, first if include_init else first + 1, last, generator)
    return ts[idx.clamp(0, ts.numel() - 1)]


def _stratified(n: int, start: int, end: int, generator) -> torch.Tensor:
    """``n`` integer draws, one in each of ``n`` equal strata of ``[start, end]`` -> [n] long."""
    bounds = torch.linspace(start, end, n + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(n, generator=generator) * (upper - lower)).long()


def clip_pair(value: Union[float, tuple, list], name: str) -> tuple[float, float]:
    """A clip range as ``(lo, hi)``: a scalar ``c`` means ``(-|c|, |c|)`` (Flow-Factory's
    ``_standardize_clip_range``); a pair needs ``lo < hi``. ``name`` is the setting, for the error."""
    if not isinstance(value, (tuple, list)):
        return -abs(float(value)), abs(float(value))
    if len(value) != 2 or not float(value[0]) < float(value[1]):
        raise ConfigError(f"{name} must be a scalar c (meaning [-c, c]) or [lo, hi] with lo < hi, got {value!r}")
    return float(value[0]), float(value[1])


def velocity_mse(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean over non-batch dims of (v - target)^2`` per sample, float32 -> ``[B]``."""
    return (v.float() - target.float()).pow(2).flatten(1).mean(dim=1)


def ramped_decay(step: int, max_decay: float, ramp_rate: float) -> float:
    """EMA decay ``min(max_decay, ramp_rate * step)`` of a fast-tracking copy ``old <- d old + (1 - d) theta``.

    DGPO's EMA reference (``min(0.3, 0.001 * step)``, per optimizer step), AWM's EMA for the KL
    (official code ``min(0.3, 0.001 * step)``; Flow-Factory's ``linear`` schedule from 0 is the same
    with ``ramp_rate = max_decay / warmup_steps``), DiffusionNFT's old policy (``min(0.5, 0.001 * step)``).
    """
    return min(float(max_decay), float(ramp_rate) * step)
