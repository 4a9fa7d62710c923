"""Deterministic (ODE) generation: evaluation sets, previews, offline datasets, and flat ODE
groups for the updates that train on finished samples only (``Needs.clean_samples``: DiffusionNFT,
online DPO / GDRO)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from ..conditions import encode_conditions
from ..ode_solvers import heun_update
from ..options import PositiveInt, check_fields
from ..sde import ode_step
from ..seeding import derive_seeds
from ..structures import GroupStructure
from ..types import FlowPolicy, RewardFn, index_cond
from .base import GroupSize, Rollout, SamplerDeclarations, Transitions
from .common import EvalCounter, sampling_setup, step_sigmas, velocity_batched
from ..scoring import ChunkScorer, Scores, ScoreFn, row_chunks


def _unique_cond(policy: FlowPolicy, prompts: list[str]) -> tuple[list[str], torch.Tensor, dict]:
    """``(distinct prompts, index [N] of each prompt among them, their conditioning [U, ...])``."""
    uniq = list(dict.fromkeys(prompts))
    pos = {p: i for i, p in enumerate(uniq)}
    index = torch.tensor([pos[p] for p in prompts], dtype=torch.long)  # [N]
    return uniq, index, encode_conditions(policy, uniq)


SOLVERS = ("euler", "heun")  # the ODE solvers of integrate / ode_generate / ode_sample


def integrate(policy: FlowPolicy, x: torch.Tensor, sigmas: torch.Tensor, cond, num_steps: int,
              max_batch: Optional[int] = None, counter: Optional[EvalCounter] = None,
              solver: str = "euler") -> torch.Tensor:
    """Integrate the probability-flow ODE from noise ``x`` [n, C, H, W] under per-row ``cond`` [n, ...]
    through ``sigmas`` [T + 1] (on x's device) -> x0 [n, C, H, W] float32. ``solver``: ``"euler"``
    (``num_steps`` model evaluations per row) or ``"heun"`` (:func:`flowrl.ode_solvers.heun_update`,
    Euler on the last step to sigma = 0: ``2 * num_steps - 1`` evaluations)."""
    if solver not in SOLVERS:
        raise ValueError(f"ODE solver must be one of {SOLVERS}, got {solver!r}")
    sig_cpu = sigmas.cpu() if solver == "heun" else None  # [T + 1]: the host reads which step ends at 0
    for i in range(num_steps):
        s, s_next = step_sigmas(sigmas, i, x.shape[0])  # [n] each
        v = velocity_batched(policy, x, s, cond, max_batch, counter)  # [n, C, H, W]
        euler = ode_step(v, x, s, s_next).sample  # [n, C, H, W]
        if solver == "euler" or float(sig_cpu[i + 1]) == 0.0:
            x = euler
            continue
        v_next = velocity_batched(policy, euler, s_next, cond, max_batch, counter).float()  # [n, C, H, W]
        x = heun_update(x, v.float(), v_next, sigmas[i], sigmas[i + 1])
    return x  # [n, C, H, W]


@torch.no_grad()
def ode_generate(policy: FlowPolicy, prompts: list[str], seeds: list[int], num_steps: int,
                 reward: Optional[RewardFn] = None, max_batch: Optional[int] = None,
                 counter: Optional[EvalCounter] = None, score: Optional[ScoreFn] = None, solver: str = "euler"
                 ) -> tuple[torch.Tensor, torch.Tensor, Scores]:
    """``len(prompts)`` ODE samples (prompt i with seed i), ``max_batch`` at a time, each chunk scored
    while the next one samples (:class:`flowrl.scoring.ChunkScorer`; ``score`` replaces the
    reward's scoring, e.g. to add held-out rewards).

    Returns ``(x0 [N, C, H, W] on the policy's device, images [N, 3, H, W] on the CPU, scores)``."""
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
    _, index, cond_u = _unique_cond(policy, list(prompts))
    return _generate(policy, index_cond(cond_u, index), list(prompts), list(seeds), num_steps, reward, max_batch,
                     counter, score, solver)


@torch.no_grad()
def _generate(policy: FlowPolicy, cond, prompts: list[str], seeds: list[int], num_steps: int,
              reward: Optional[RewardFn], max_batch: Optional[int], counter: Optional[EvalCounter],
              score: Optional[ScoreFn] = None, solver: str = "euler") -> tuple[torch.Tensor, torch.Tensor, Scores]:
    """:func:`ode_generate` under per-sample ``cond`` [N, ...]."""
    x, _, sigmas = sampling_setup(policy, list(seeds), num_steps)  # [N, C, H, W], [T + 1] on x's device
    xs, images = [], []
    with ChunkScorer(reward, score) as scorer:
        for rows in row_chunks(x.shape[0], max_batch):
            x0 = integrate(policy, x[rows], sigmas, {k: v[rows] for k, v in cond.items()}, num_steps, max_batch, counter,
                           solver)  # [n_c, C, H, W]
            xs.append(x0)
            images.append(policy.decode(x0).float().cpu())  # [n_c, 3, H, W]
            scorer.submit(images[-1], list(prompts[rows]))
        scores = scorer.result()
    return torch.cat(xs), torch.cat(images), scores


def ode_sample(policy: FlowPolicy, prompts: list[str], seeds: list[int], num_steps: int,
               max_batch: Optional[int] = None, counter: Optional[EvalCounter] = None, solver: str = "euler"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate ``len(prompts)`` samples (prompt i with seed i; :func:`ode_generate`, ``max_batch`` rows at
    a time) -> (x0 [N, ...], images [N, 3, H, W]), both on the CPU."""
    if len(prompts) != len(seeds):
        raise ValueError(f"ode_sample got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
    x0, images, _ = ode_generate(policy, list(prompts), list(seeds), num_steps, None, max_batch, counter,
                                 solver=solver)
    return x0.cpu(), images


def ode_rollout(policy: FlowPolicy, prompts: list[str], seeds: list[int], num_steps: int,
                reward: Optional[RewardFn] = None, max_batch: Optional[int] = None) -> Rollout:
    """``len(seeds) // len(prompts)`` ODE samples per prompt (prompt-major seeds) as a
    :class:`Rollout` with no stochastic transitions (for DiffusionNFT); ``x0`` and the kept
    conditioning stay on the policy's device. Chunks of ``max_batch`` are scored while the next samples."""
    t0 = time.perf_counter()
    if not prompts or len(seeds) % len(prompts):
        raise ValueError(f"need a positive multiple of {len(prompts)} prompts' seeds, got {len(seeds)} seeds")
    k = len(seeds) // len(prompts)
    prompt_index = torch.arange(len(prompts)).repeat_interleave(k)  # [N]
    per_sample = [prompts[i] for i in prompt_index.tolist()]
    counter = EvalCounter()
    uniq, index, cond_u = _unique_cond(policy, per_sample)
    x0, images, scores = _generate(policy, index_cond(cond_u, index), per_sample, list(seeds), num_steps, reward,
                                   max_batch, counter)
    pos = {p: i for i, p in enumerate(uniq)}
    cond_p = index_cond(cond_u, torch.tensor([pos[p] for p in prompts], dtype=torch.long))  # [P, ...]
    return Rollout(
        prompts=list(prompts), prompt_index=prompt_index, seeds=torch.tensor(list(seeds), dtype=torch.long),
        group_index=prompt_index.clone(), x0=x0, images=images, rewards=scores.rewards,
        transitions=Transitions.empty(tuple(x0.shape[1:])), sigmas=policy.sigmas(num_steps).float().cpu(),
        step_type="ode", noise_level=0.0, layout=GroupStructure(), reward_components=scores.components, cond=cond_p,
        stats={"model_evals": counter.rows, "rollout_seconds": time.perf_counter() - t0 - scores.wait_seconds,
               **scores.stats()})


@dataclass
class ODEGroupSampler(SamplerDeclarations):
    """``group_size`` deterministic ODE samples per prompt, one seed each: the flat sampler of
    DiffusionNFT (arXiv 2509.16117) and of online DPO / GDRO, which train on finished samples, not
    log-probs (updates declaring ``Needs.clean_samples``; GRPO has no stochastic transitions to train on here)."""

    group_size: GroupSize = 8
    num_steps: PositiveInt = 10
    max_batch: Optional[PositiveInt] = None
    stores_transitions: ClassVar[bool] = False  # class constant: the trainer's GRPO loss cannot use this sampler

    def __post_init__(self) -> None:
        check_fields(self)  # the declared types and ranges (flowrl.options)

    @property
    def samples_per_prompt(self) -> int:
        return self.group_size

    def smoke_options(self) -> dict:
        """2 samples in 3 steps (a training time after the first: AWM's ``discrete_wo_init``)."""
        return {"group_size": 2, "num_steps": 3, "max_batch": None}

    def check_available(self) -> None:
        """Nothing to check: this sampler runs wherever the policy runs (the Sampler protocol)."""

    @torch.no_grad()
    def __call__(self, policy: FlowPolicy, prompts: list[str], reward: Optional[RewardFn] = None, seed: int = 0, *,
                 iteration: int = 0, seeds: Optional[list[int]] = None) -> Rollout:
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        n = len(prompts) * self.group_size
        seeds = list(seeds) if seeds is not None else derive_seeds(seed, n)
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} samples")
        return ode_rollout(policy, list(prompts), seeds, self.num_steps, reward, self.max_batch)
