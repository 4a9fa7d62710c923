"""Helpers every sampler shares: chunked velocity calls and evaluation counting."""
from __future__ import annotations

from typing import Optional

import torch

from ..types import Conditioning, FlowPolicy, index_cond


class EvalCounter:
    """Counts the latent rows sent through ``policy.velocity`` (model evaluations)."""

    def __init__(self) -> None:
        self.rows = 0
        self.calls = 0


def velocity_batched(policy: FlowPolicy, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                     max_batch: Optional[int] = None, counter: Optional[EvalCounter] = None) -> torch.Tensor:
    """``policy.velocity`` over rows of ``x`` [B, ...] with ``sigma`` [B], in chunks of ``max_batch``."""
    b = x.shape[0]
    step = b if not max_batch else max_batch
    outs = []
    for start in range(0, b, max(step, 1)):
        idx = torch.arange(start, min(b, start + step))
        c = cond if step >= b else index_cond(cond, idx)
        outs.append(policy.velocity(x[idx] if step < b else x, sigma[idx] if step < b else sigma, c))
        if counter is not None:
            counter.rows += len(idx)
            counter.calls += 1
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, ...]


def step_sigmas(sigmas: torch.Tensor, i: int, n: int, j: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigma_i, sigma_j)`` each expanded to ``[n]`` float32; ``j`` defaults to ``i + 1`` (a step
    that skips sigmas, as a thinned ODE segment does, passes its own ``j``)."""
    j = i + 1 if j is None else j
    return sigmas[i].float().expand(n).clone(), sigmas[j].float().expand(n).clone()
