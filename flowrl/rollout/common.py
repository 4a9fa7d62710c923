"""Helpers every sampler shares: chunked velocity calls and evaluation counting."""
from __future__ import annotations

from typing import Optional

import torch

from ..types import Conditioning, FlowPolicy


class EvalCounter:
    """Counts the latent rows sent through ``policy.velocity`` (model evaluations)."""

    def __init__(self) -> None:
        self.rows = 0
        self.calls = 0


def velocity_batched(policy: FlowPolicy, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                     max_batch: Optional[int] = None, counter: Optional[EvalCounter] = None) -> torch.Tensor:
    """``policy.velocity`` over rows of ``x`` [B, ...] with ``sigma`` [B], in chunks of ``max_batch``.

    Chunks are row slices (views; no index tensor is sent to the device per chunk)."""
    b = x.shape[0]
    step = max(b if not max_batch else max_batch, 1)
    outs = []
    for start in range(0, b, step):
        stop = min(b, start + step)
        whole = start == 0 and stop == b
        c = cond if whole else {k: v[start:stop] for k, v in cond.items()}
        outs.append(policy.velocity(x if whole else x[start:stop], sigma if whole else sigma[start:stop], c))
        if counter is not None:
            counter.rows += stop - start
            counter.calls += 1
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, ...]


def step_sigmas(sigmas: torch.Tensor, i: int, n: int, j: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sigma_i, sigma_j)`` each expanded to ``[n]`` float32; ``j`` defaults to ``i + 1`` (a step
    that skips sigmas, as a thinned ODE segment does, passes its own ``j``)."""
    j = i + 1 if j is None else j
    return sigmas[i].float().expand(n).clone(), sigmas[j].float().expand(n).clone()


def sampling_setup(policy: FlowPolicy, seeds: list[int],
                   num_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, sigmas, sigmas_on_device)``: the initial noise float32 [N, C, H, W] on the policy's device,
    the schedule [T + 1] float32 on the CPU (for Python-side floats) and the same on ``x``'s device
    (one copy per rollout, so per-step sigma tensors need none)."""
    x = policy.initial_noise(list(seeds)).float()  # [N, C, H, W]
    sigmas = policy.sigmas(num_steps).float().cpu()  # [T + 1]
    return x, sigmas, sigmas.to(x.device)
