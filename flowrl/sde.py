"""One sampling step of a rectified flow, with the log-probability of the transition.

Every step function has the signature
``(velocity, latents, sigma, sigma_next, *, noise_level=..., prev_sample=None,
generator=None, noise=None) -> StepOutput`` (docs/algorithms.md §2):

* ``velocity``/``latents``: ``[B, ...]`` tensors of any float dtype; the math runs in float32.
* ``sigma``/``sigma_next``: floats or ``[B]`` tensors, ``sigma_next < sigma`` (``dt < 0``).
* ``prev_sample``: if given, the transition ``latents -> prev_sample`` is *scored* instead of
  sampled (the ddpo habit), so a stored rollout can be re-evaluated under new weights.
* ``noise``: a standard-normal ``[B, ...]`` draw to use instead of sampling one (samplers pass
  per-seed noise so that a sample does not depend on its batch-mates).

``StepOutput.log_prob`` is the Gaussian log-density of the sample given ``latents``,
**averaged** (not summed) over all non-batch dimensions, constants included, shape ``[B]``,
in nats per element. PPO ratios ``exp(new - old)`` of such means are why clip ranges are
~1e-4..1e-3. A deterministic step (std 0) has ``log_prob = 0``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

import torch

from .registry import Registry

Sigma = Union[float, torch.Tensor]
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    sample: torch.Tensor    # [B, ...] float32, the next latent x_{t+dt}
    mean: torch.Tensor      # [B, ...] float32, E[sample | latents]
    std: torch.Tensor       # [B] float32, standard deviation of sample given latents
    log_prob: torch.Tensor  # [B] float32, mean over non-batch dims of the Gaussian log-density


def flow_interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The rectified-flow forward process ``x_t = (1 - t) x0 + t eps`` (Liu et al. 2022, arXiv 2209.03003;
    flowrl's sigma is ``t``); its velocity target is ``eps - x0``. ``t`` broadcasts against ``x0``
    (e.g. ``[B, 1, 1, 1]`` for ``x0`` [B, C, H, W]); the caller chooses the dtype."""
    return (1 - t) * x0 + t * noise


def _bcast(s: Sigma, ref: torch.Tensor) -> torch.Tensor:
    """Float or [B] sigma -> float32 tensor broadcastable against ``ref`` [B, ...]."""
    t = torch.as_tensor(s, dtype=torch.float32, device=ref.device)
    if t.ndim == 0:
        t = t.expand(ref.shape[0])
    if t.shape != (ref.shape[0],):
        raise ValueError(f"sigma must be a float or a [B] tensor with B={ref.shape[0]}, got shape {tuple(t.shape)}")
    return t.view(-1, *([1] * (ref.ndim - 1)))  # [B, 1, ..., 1]


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element Gaussian log-density averaged over non-batch dims -> [B] float32.

    ``scale`` broadcasts against ``sample``; rows whose scale is 0 (deterministic) get 0.
    """
    dims = tuple(range(1, sample.ndim))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    lp = -((sample.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _HALF_LOG_2PI  # [B, ...]
    lp = lp.mean(dim=dims)  # [B]
    deterministic = (scale <= 0).reshape(scale.shape[0], -1).all(dim=1)
    return torch.where(deterministic, torch.zeros_like(lp), lp)


def _finish(mean: torch.Tensor, scale: torch.Tensor, prev_sample, generator, noise) -> StepOutput:
    """Draw (or take) the sample ``mean + scale * eps`` and score it."""
    if prev_sample is not None:
        sample = prev_sample.to(torch.float32)
    else:
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        sample = mean + scale * noise.to(torch.float32)
    std = scale.reshape(scale.shape[0], -1)[:, 0].expand(mean.shape[0]).clone()  # [B]
    return StepOutput(sample, mean, std, gaussian_log_prob(sample, mean, scale))


def ode_step(velocity, latents, sigma: Sigma, sigma_next: Sigma, *, noise_level: float = 0.0,
             prev_sample=None, generator=None, noise=None) -> StepOutput:
    """Euler step ``x + dt * v`` (equals ``FlowMatchEulerDiscreteScheduler.step`` in fp32).

    Deterministic: ``std = 0``, ``log_prob = 0``; ``noise_level`` is ignored.
    """
    x = latents.to(torch.float32)
    s, s_next = _bcast(sigma, x), _bcast(sigma_next, x)
    mean = x + (s_next - s) * velocity.to(torch.float32)  # [B, ...]
    sample = mean if prev_sample is None else prev_sample.to(torch.float32)
    zero = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)  # [B]
    return StepOutput(sample, mean, zero, zero.clone())


def sde_step(velocity, latents, sigma: Sigma, sigma_next: Sigma, *, noise_level: float = 0.7,
             prev_sample=None, generator=None, noise=None) -> StepOutput:
    """Flow-GRPO SDE step (Liu et al. 2025, arXiv 2505.05470, eq. 9-10).

    ``std_t = a sqrt(sigma / (1 - sigma'))`` with ``sigma' = sigma_next`` when ``sigma == 1``
    (Flow-GRPO uses ``sigmas[1]``, which is ``sigma_next`` at the first step);
    ``mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt``;
    ``sample = mean + std_t sqrt(-dt) eps``.
    """
    x, v = latents.to(torch.float32), velocity.to(torch.float32)
    s, s_next = _bcast(sigma, x), _bcast(sigma_next, x)
    dt = s_next - s
    denom = 1 - torch.where(s == 1, s_next, s)
    std_t = noise_level * torch.sqrt(s / denom)
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt  # [B, ...]
    scale = std_t * torch.sqrt(-dt)
    return _finish(mean, scale, prev_sample, generator, noise)


def sde_wan_step(velocity, latents, sigma: Sigma, sigma_next: Sigma, *, noise_level: float = 1.0,
                 prev_sample=None, generator=None, noise=None) -> StepOutput:
    """Flow-GRPO's SDE step for Wan2.1: :func:`sde_step`'s mean with a noise coefficient linear in sigma.

    ``std_t = a sigma``; ``mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt``
    (Liu et al. 2025, arXiv 2505.05470, eq. 9); ``sample = mean + std_t sqrt(-dt) eps``. Flow-GRPO's
    Wan code (yifan123/flow_grpo ``flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py``,
    ``sde_step_with_logprob``, called by ``scripts/train_wan2_1.py``) sets ``std_t = sigma_min +
    (sigma_max - sigma_min) sigma`` with ``sigma_max = sigmas[1]`` and ``sigma_min = sigmas[-1] = 0``
    of its schedule, i.e. ``a = sigmas[1]``: 0.9828 for Wan2.1's 20-step UniPC schedule at flow shift 3
    (``noise_level`` is ``a``; 1.0 by default, the limit of many steps). Its KL to the reference divides by
    the whole ``(std_t sqrt(-dt))^2`` (the exact form; see ``SCALE_IS_NOISE_COEFFICIENT``).
    """
    x, v = latents.to(torch.float32), velocity.to(torch.float32)
    s, s_next = _bcast(sigma, x), _bcast(sigma_next, x)
    dt = s_next - s
    std_t = noise_level * s
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt  # [B, ...]
    scale = std_t * torch.sqrt(-dt)
    return _finish(mean, scale, prev_sample, generator, noise)


def dance_step(velocity, latents, sigma: Sigma, sigma_next: Sigma, *, noise_level: float = 0.3,
               prev_sample=None, generator=None, noise=None) -> StepOutput:
    """DanceGRPO SDE step (Xue et al. 2025, arXiv 2505.07818, ``flux_step`` with sde_solver).

    ``x0 = x - sigma v``; ``score = -(x - (1 - sigma) x0) / sigma^2``;
    ``mean = x + dt v - 0.5 eta^2 score dt``; ``sample = mean + eta sqrt(-dt) eps``.
    """
    x, v = latents.to(torch.float32), velocity.to(torch.float32)
    s, s_next = _bcast(sigma, x), _bcast(sigma_next, x)
    dt = s_next - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mean = x + dt * v + dt * (-0.5 * noise_level**2) * score  # [B, ...]
    scale = noise_level * torch.sqrt(-dt)
    return _finish(mean, scale, prev_sample, generator, noise)


def cps_step(velocity, latents, sigma: Sigma, sigma_next: Sigma, *, noise_level: float = 0.8,
             prev_sample=None, generator=None, noise=None) -> StepOutput:
    """Coefficient-preserving sampling (Flow-GRPO ``sde_type="cps"``).

    ``std = sigma_next sin(eta pi / 2)``; ``mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1``
    with ``x0 = x - sigma v``, ``x1 = x + (1 - sigma) v``. Unlike the peers, the full Gaussian
    density (constants included) is kept, so log-probs compare across step types.
    """
    x, v = latents.to(torch.float32), velocity.to(torch.float32)
    s, s_next = _bcast(sigma, x), _bcast(sigma_next, x)
    x0 = x - s * v
    x1 = x + (1 - s) * v
    scale = s_next * math.sin(noise_level * math.pi / 2)
    mean = (1 - s_next) * x0 + torch.sqrt(torch.clamp(s_next**2 - scale**2, min=0)) * x1  # [B, ...]
    return _finish(mean, scale, prev_sample, generator, noise)


def cps_flow_grpo_step(velocity, latents, sigma: Sigma, sigma_next: Sigma, *, noise_level: float = 0.8,
                       prev_sample=None, generator=None, noise=None) -> StepOutput:
    """CPS with the log-prob of Flow-GRPO's code: ``-mean((sample - mean)^2)``, no ``1 / (2 std^2)``, no constants.

    Same samples, means and std as :func:`cps_step`. Only differences of such log-probs mean
    anything (PPO ratios), and they are ``2 std^2`` times the Gaussian ones (x0.6 ... x7.2 on
    SD3's steps, far more at the last), so Flow-GRPO's CPS clip range only carries over here.
    A deterministic row (``sigma_next = 0``) gets log_prob 0, as in :func:`cps_step`.
    """
    out = cps_step(velocity, latents, sigma, sigma_next, noise_level=noise_level, prev_sample=prev_sample,
                   generator=generator, noise=noise)
    dims = tuple(range(1, out.sample.ndim))
    lp = -((out.sample.detach() - out.mean) ** 2).mean(dim=dims)  # [B]
    return StepOutput(out.sample, out.mean, out.std, torch.where(out.std > 0, lp, torch.zeros_like(lp)))


StepFn = Callable[..., StepOutput]
STEPS = Registry("step type", {"ode": ode_step, "sde": sde_step, "sde_wan": sde_wan_step, "dance": dance_step,
                               "cps": cps_step, "cps_flow_grpo": cps_flow_grpo_step})
DEFAULT_NOISE_LEVEL = {"ode": 0.0, "sde": 0.7, "sde_wan": 1.0, "dance": 0.3, "cps": 0.8, "cps_flow_grpo": 0.8}
# steps whose Flow-GRPO KL divides by the step's whole scale squared (its ``kl_form: flow_grpo`` is then the exact
# form): CPS, whose noise coefficient ``std_dev_t`` is the scale itself (no sqrt(-dt) factor), and the Wan step,
# whose training script multiplies the coefficient by sqrt(-dt) again (scripts/train_wan2_1.py's kl_loss)
SCALE_IS_NOISE_COEFFICIENT = frozenset({"cps", "cps_flow_grpo", "sde_wan"})


def get_step(name: str) -> StepFn:
    """Step function by name; an unknown name lists the valid ones (and the closest)."""
    return STEPS.get(name)
