"""Deterministic solvers for the ODE segments of a rollout (MixGRPO-Flash, arXiv 2507.21802).

Rectified flow: ``x_s = (1 - s) x0 + s eps`` (``alpha = 1 - s``), velocity ``v = eps - x0``, so the
data prediction is ``x0_hat = x - s v``. DPM-Solver++ (Lu et al. 2022, arXiv 2211.01095, alg. 2)
in this parameterisation, with ``lambda(s) = log((1 - s) / s)`` and ``h = lambda(s') - lambda(s)``:

- first order (equals the Euler step for rectified flow):
  ``x' = (s' / s) x + (alpha' - s' alpha / s) D`` with ``D = x0_hat``;
- 2M: the same with ``D = (1 + 1 / (2 r)) x0_hat - 1 / (2 r) x0_hat_prev``, ``r = h_prev / h``.

The first step after ``sigma = 1`` (``lambda = -inf``), the step to ``sigma = 0`` and a step
with no usable previous prediction fall back to first order, as diffusers' solver does
(``lower_order_final``); samplers then take the Euler step itself (:func:`second_order` says
which), so a first-order step is bit-identical to Euler. All arithmetic in float32; every
function is pure.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

SOLVERS = ("euler", "dpmpp_2m")


def _lam(s: float) -> float:
    """``log((1 - s) / s)``: -inf at s = 1, +inf at s = 0."""
    if s >= 1.0:
        return -math.inf
    if s <= 0.0:
        return math.inf
    return math.log((1.0 - s) / s)


def second_order(sigma_prev: Optional[float], sigma: float, sigma_next: float) -> bool:
    """Whether a 2M step from ``sigma`` to ``sigma_next`` can use the previous prediction at
    ``sigma_prev`` (both lambda steps finite); otherwise the step is first order, i.e. Euler."""
    return sigma_prev is not None and 0.0 < float(sigma_next) < float(sigma) < float(sigma_prev) < 1.0


def data_prediction(x: torch.Tensor, v: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x0_hat = x - sigma v`` in float32 (shape of ``x``)."""
    return x.float() - float(sigma) * v.float()


def dpmpp_2m_step(x: torch.Tensor, x0: torch.Tensor, sigma: float, sigma_next: float,
                  x0_prev: Optional[torch.Tensor] = None, sigma_prev: Optional[float] = None) -> torch.Tensor:
    """One DPM-Solver++(2M) step from ``sigma`` to ``sigma_next`` (scalars; ``sigma_next < sigma``).

    ``x0`` is the data prediction at (x, sigma); ``x0_prev`` / ``sigma_prev`` those of the previous
    step on the same trajectory (None: first order). Returns ``x'`` float32, shape of ``x``.
    """
    s, sn = float(sigma), float(sigma_next)
    if not 0.0 <= sn < s <= 1.0:
        raise ValueError(f"need 0 <= sigma_next < sigma <= 1, got sigma={s}, sigma_next={sn}")
    x, d = x.float(), x0.float()
    if sn == 0.0:
        return d.clone()  # lambda' = inf: the step lands on the data prediction (first order)
    h = _lam(sn) - _lam(s)
    if x0_prev is not None and second_order(sigma_prev, s, sn):
        r = (_lam(s) - _lam(float(sigma_prev))) / h
        d = (1.0 + 1.0 / (2.0 * r)) * d - (1.0 / (2.0 * r)) * x0_prev.float()
    alpha, alpha_n = 1.0 - s, 1.0 - sn
    return (sn / s) * x + (alpha_n - sn * alpha / s) * d


def compressed_sigmas(sigmas: torch.Tensor, start: int, steps: Optional[int]) -> list[int]:
    """Indices into ``sigmas`` [T + 1] for the segment from ``start`` to the end in ``steps`` steps
    (evenly spaced, always keeping ``start`` and ``T``); None or ``steps >= T - start`` keeps all."""
    t = len(sigmas) - 1
    if not 0 <= start <= t:
        raise ValueError(f"start must be in [0, {t}], got {start}")
    if steps is None or steps >= t - start:
        return list(range(start, t + 1))
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    idx = torch.linspace(start, t, steps + 1).round().long().tolist()
    return sorted(set(idx))


def heun_update(x: torch.Tensor, v: torch.Tensor, v_next: torch.Tensor, sigma: torch.Tensor,
                sigma_next: torch.Tensor) -> torch.Tensor:
    """Heun's second-order step (Karras et al. 2022, arXiv 2206.00364, Alg. 1): ``x + dt (v + v') / 2``
    with ``v'`` the velocity at the Euler prediction ``x + dt v`` at ``sigma_next``; ``dt = sigma_next - sigma``
    (0-dim or broadcastable). Float32 ``x`` [N, ...] -> [N, ...]."""
    return x + (sigma_next - sigma) * 0.5 * (v + v_next)
