"""What every sampler returns: a flat set of stochastic transitions plus the finished samples.

DESIGN.md: each method differs only in how its sampler fills these tensors and how
``flowrl.advantages`` turns rewards + structure into one advantage per transition; the
GRPO-family update needs nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from ..types import RewardFn


@dataclass
class Transitions:
    """M stored stochastic transitions ``latents -> next_latents`` (the trained ones)."""

    latents: torch.Tensor        # [M, C, H, W] float32, x at sigma
    next_latents: torch.Tensor   # [M, C, H, W] float32, the sampled x at sigma_next
    sigma: torch.Tensor          # [M] float32
    sigma_next: torch.Tensor     # [M] float32
    prompt_index: torch.Tensor   # [M] long, row of Rollout.prompts
    sample_index: torch.Tensor   # [M] long, finished sample this transition leads to (-1: several)
    step: torch.Tensor           # [M] long, step index i of sigma_i
    old_log_prob: torch.Tensor   # [M] float32, log-prob under the sampling policy (see flowrl.sde)
    weight: torch.Tensor         # [M] float32, per-transition loss weight (noise-aware, else 1)

    def __len__(self) -> int:
        return self.latents.shape[0]

    def select(self, index: torch.Tensor) -> "Transitions":
        """Rows ``index`` [K] of every field."""
        return Transitions(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @staticmethod
    def concat(parts: list["Transitions"]) -> "Transitions":
        return Transitions(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Transitions)})

    @staticmethod
    def empty(latent_shape: tuple[int, ...]) -> "Transitions":
        z = torch.zeros(0)
        zl = torch.zeros(0, dtype=torch.long)
        return Transitions(torch.zeros((0, *latent_shape)), torch.zeros((0, *latent_shape)), z, z.clone(),
                           zl, zl.clone(), zl.clone(), z.clone(), z.clone())


@dataclass
class Rollout:
    """Finished samples, their rewards, and the transitions to train on.

    ``structure`` names the advantage function of ``flowrl.advantages.ADVANTAGES`` that
    turns this rollout into one advantage per transition; ``extras`` holds what that
    function needs beyond the common fields (tree links for BranchGRPO, ...).
    """

    prompts: list[str]                 # the P distinct prompts
    prompt_index: torch.Tensor         # [N] long, prompt of each finished sample
    seeds: torch.Tensor                # [N] long, seed of each sample's initial noise
    group_index: torch.Tensor          # [N] long, advantage-normalisation group
    x0: torch.Tensor                   # [N, C, H, W] final latents
    images: torch.Tensor               # [N, 3, H, W] in [0, 1]
    rewards: torch.Tensor              # [N] float32 (weighted total when several rewards)
    transitions: Transitions           # M trained transitions
    sigmas: torch.Tensor               # [T + 1] schedule used
    step_type: str                     # name in flowrl.sde.STEPS used for the stored transitions
    noise_level: float
    structure: str = "group"
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    extras: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)  # model_evals, seconds, ...

    @property
    def num_samples(self) -> int:
        return self.x0.shape[0]


def score_images(reward: Optional[RewardFn], images: torch.Tensor, prompts: list[str],
                 **meta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run a reward on decoded images -> (total [N] float32, components name -> [N]).

    A reward with a ``components`` method (``flowrl.rewards.MultiReward``) reports its parts;
    a wrong shape is an error that names the reward, never a silent broadcast.
    """
    n = images.shape[0]
    if reward is None:
        return torch.full((n,), float("nan")), {}
    comps: dict[str, torch.Tensor] = {}
    if hasattr(reward, "components"):
        comps = {k: _check_reward(v, n, k) for k, v in reward.components(images, prompts, **meta).items()}
        total = reward.combine(comps)
    else:
        total = reward(images, prompts, **meta)
    name = getattr(reward, "name", type(reward).__name__)
    return _check_reward(total, n, name), comps


def _check_reward(r, n: int, name: str) -> torch.Tensor:
    r = torch.as_tensor(r).detach().to("cpu", torch.float32)
    if r.shape != (n,):
        raise ValueError(f"reward {name!r} returned shape {tuple(r.shape)} for {n} images; "
                         f"a reward must return one float per image, shape [{n}]")
    return r
