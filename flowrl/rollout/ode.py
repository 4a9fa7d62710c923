"""Deterministic (ODE) generation: evaluation sets, previews, offline datasets."""
from __future__ import annotations

from typing import Optional

import torch

from ..sde import ode_step
from ..types import FlowPolicy, index_cond
from .common import EvalCounter, step_sigmas, velocity_batched


@torch.no_grad()
def ode_sample(policy: FlowPolicy, prompts: list[str], seeds: list[int], num_steps: int,
               max_batch: Optional[int] = None, counter: Optional[EvalCounter] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler-integrate ``len(prompts)`` samples (prompt i with seed i) -> (x0 [N, ...], images [N, 3, H, W])."""
    if len(prompts) != len(seeds):
        raise ValueError(f"ode_sample got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
    uniq = list(dict.fromkeys(prompts))
    index = torch.tensor([uniq.index(p) for p in prompts])  # [N]
    cond = index_cond(policy.encode_prompts(uniq), index)
    x = policy.initial_noise(list(seeds)).float()  # [N, C, H, W]
    sigmas = policy.sigmas(num_steps).float()
    for i in range(num_steps):
        s, s_next = step_sigmas(sigmas, i, x.shape[0])
        v = velocity_batched(policy, x, s, cond, max_batch, counter)
        x = ode_step(v, x, s, s_next).sample
    return x.cpu(), policy.decode(x).float().cpu()
