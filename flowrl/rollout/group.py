"""Flat group rollouts (Flow-GRPO / DanceGRPO / MixGRPO, docs/algorithms.md §3)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Optional

import torch

from ..conditions import encode_conditions
from ..options import Between, NonNegativeFloat, NonNegativeInt, PositiveInt, check_fields
from ..seeding import derive_seeds, seeded_randn
from ..sde import DEFAULT_NOISE_LEVEL, get_step, ode_step
from ..ode_solvers import SOLVERS, compressed_sigmas, data_prediction, dpmpp_2m_step, second_order
from ..structures import GroupStructure
from ..types import FlowPolicy, RewardFn, index_cond
from .base import GroupSize, Rollout, SamplerDeclarations, Transitions
from .common import EvalCounter, sampling_setup, step_sigmas, velocity_batched
from ..scoring import ChunkScorer, row_chunks


@dataclass
class GroupSampler(SamplerDeclarations):
    """``group_size`` trajectories per prompt, every row of a step in one ``velocity`` call.

    Args:
        group_size: samples per prompt (>= 2: a group of one has no advantage signal).
        num_steps: denoising steps T.
        step: stochastic step type, one of ``flowrl.sde.STEPS`` (``"sde"``, ``"dance"``, ``"cps"``).
        noise_level: the step's noise parameter (``a`` / ``eta``); None takes the step's default.
        sde_window: if set, noise only in ``sde_window`` consecutive steps (Flow-GRPO-Fast /
            MixGRPO), ODE elsewhere; only window transitions are stored.
        window_start: first step of the window; with ``window_shift_every = k`` the window
            slides one step every k iterations (MixGRPO), wrapping around.
        timestep_fraction: fraction of the stochastic steps stored for training, from the
            first (Flow-GRPO ``timestep_fraction``; 0.99 with T = 10 skips the last step).
        max_batch: chunk velocity calls to at most this many rows (memory), None = all.
        ode_solver: solver of the deterministic (out-of-window) steps: ``"euler"`` or
            ``"dpmpp_2m"`` (DPM-Solver++(2M), second order: MixGRPO-Flash).
        post_window_steps: if set, the ODE segment after the window takes this many steps
            (sigmas evenly thinned) instead of all remaining ones (MixGRPO-Flash); needs
            ``sde_window``. Window transitions and their log-probs are unchanged.
    """

    group_size: GroupSize = 4
    num_steps: PositiveInt = 10
    step: str = "sde"
    noise_level: Optional[NonNegativeFloat] = None
    sde_window: Optional[PositiveInt] = None
    window_start: NonNegativeInt = 0
    window_shift_every: Optional[PositiveInt] = None
    timestep_fraction: Annotated[float, Between(0, 1, low_open=True)] = 1.0
    max_batch: Optional[PositiveInt] = None
    ode_solver: Literal[SOLVERS] = "euler"
    post_window_steps: Optional[PositiveInt] = None
    stores_transitions: ClassVar[bool] = True  # every stochastic step it trains on is stored

    def __post_init__(self) -> None:
        check_fields(self)  # the declared types and ranges (flowrl.options)
        get_step(self.step)
        if self.step == "ode":
            raise ValueError("GroupSampler needs a stochastic step ('sde', 'dance' or 'cps'); "
                             "'ode' has no log-probabilities to train on")
        if self.noise_level is None:
            self.noise_level = DEFAULT_NOISE_LEVEL[self.step]
        if self.sde_window is not None and self.sde_window > self.num_steps:
            raise ValueError(f"sde_window must be in [1, num_steps={self.num_steps}], got {self.sde_window}")
        if self.post_window_steps is not None and self.sde_window is None:
            raise ValueError("post_window_steps compresses the ODE segment after the SDE window; set "
                             "sde_window too (MixGRPO-Flash), or remove post_window_steps")

    @property
    def samples_per_prompt(self) -> int:
        """Finished samples per prompt: the trainer's batch unit."""
        return self.group_size

    def smoke_options(self) -> dict:
        """2 samples in 2 steps; an SDE window of 1 from the first step where one is set."""
        window = {"sde_window": 1, "window_start": 0} if self.sde_window else {}
        return {"group_size": 2, "num_steps": 2, "max_batch": None, **window}

    def check_available(self) -> None:
        """Nothing to check: this sampler runs wherever the policy runs (the Sampler protocol)."""

    def sde_steps(self, iteration: int = 0) -> list[int]:
        """Steps that inject noise at this training iteration."""
        if self.sde_window is None:
            return list(range(self.num_steps))
        span = self.num_steps - self.sde_window + 1
        start = self.window_start
        if self.window_shift_every:
            start += iteration // self.window_shift_every
        start %= span
        return list(range(start, start + self.sde_window))

    def trained_steps(self, iteration: int = 0) -> list[int]:
        steps = self.sde_steps(iteration)
        return steps[: max(1, int(len(steps) * self.timestep_fraction + 1e-9))]

    def step_plan(self, iteration: int = 0) -> list[tuple[int, int]]:
        """``(i, j)`` pairs of sigma indices, one per model evaluation: every step up to the window's
        end, then the (possibly thinned, ``post_window_steps``) segment after it."""
        end = max(self.sde_steps(iteration)) + 1
        head = [(i, i + 1) for i in range(end)]
        tail = compressed_sigmas(torch.zeros(self.num_steps + 1), end, self.post_window_steps)
        return head + list(zip(tail[:-1], tail[1:]))

    @torch.no_grad()
    def __call__(self, policy: FlowPolicy, prompts: list[str], reward: Optional[RewardFn] = None,
                 seed: int = 0, *, iteration: int = 0, seeds: Optional[list[int]] = None) -> Rollout:
        """Sample ``len(prompts) * group_size`` images; ``seeds`` overrides the derived ones."""
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        t0 = time.perf_counter()
        p, g = len(prompts), self.group_size
        n = p * g
        prompt_index = torch.arange(p).repeat_interleave(g)  # [N]
        seeds = list(seeds) if seeds is not None else derive_seeds(seed, n)
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} samples")
        cond_p = encode_conditions(policy, prompts)  # [P, ...]
        cond = index_cond(cond_p, prompt_index)  # [N, ...]
        x, sigmas, sig_dev = sampling_setup(policy, seeds, self.num_steps)  # [N, C, H, W], [T + 1] CPU / device
        counter = EvalCounter()
        by_step: dict[int, list[Transitions]] = {}  # step -> its transitions, one part per chunk
        x0s = []
        images = []
        per_sample = [prompts[i] for i in prompt_index.tolist()]
        with ChunkScorer(reward) as scorer:
            for rows in row_chunks(n, self.max_batch):  # chunk-major: a finished chunk is scored while the next samples
                x0, parts = self._denoise(policy, x[rows], {k: v[rows] for k, v in cond.items()}, sigmas, sig_dev,
                                          seeds[rows], prompt_index[rows], torch.arange(rows.start, rows.stop),
                                          iteration, counter)
                for i, part in parts:
                    by_step.setdefault(i, []).append(part)
                x0s.append(x0)
                images.append(policy.decode(x0).float().cpu())  # [n_c, 3, H, W]
                scorer.submit(images[-1], per_sample[rows])
            scores = scorer.result()
        x = torch.cat(x0s)  # [N, C, H, W]
        parts = [part for i in sorted(by_step) for part in by_step[i]]  # step-major, rows in sample order
        return Rollout(
            prompts=list(prompts), prompt_index=prompt_index, seeds=torch.tensor(seeds, dtype=torch.long),
            group_index=prompt_index.clone(), x0=x, images=torch.cat(images), rewards=scores.rewards,
            transitions=Transitions.concat(parts) if parts else Transitions.empty(tuple(x.shape[1:])),
            sigmas=sigmas, step_type=self.step, noise_level=float(self.noise_level),
            layout=GroupStructure(), reward_components=scores.components, cond=cond_p,
            stats={"model_evals": counter.rows, "rollout_seconds": time.perf_counter() - t0 - scores.wait_seconds,
                   **scores.stats()})

    def _denoise(self, policy: FlowPolicy, x: torch.Tensor, cond, sigmas: torch.Tensor, sig_dev: torch.Tensor,
                 seeds: list[int], prompt_index: torch.Tensor, sample_index: torch.Tensor, iteration: int,
                 counter: EvalCounter) -> tuple[torch.Tensor, list[tuple[int, Transitions]]]:
        """The step plan on one chunk: ``x`` [n, C, H, W] noise, ``cond`` / ``seeds`` / ``prompt_index`` /
        ``sample_index`` [n] its rows. Returns ``(x0 [n, C, H, W], [(step, its transitions)])``, both
        where the sampler made them (no per-step copy to the host)."""
        n = x.shape[0]
        stoch, trained = set(self.sde_steps(iteration)), set(self.trained_steps(iteration))
        step_fn = get_step(self.step)
        parts = []
        x0_prev = sig_prev = None  # the previous ODE step's data prediction (DPM-Solver++ 2M)
        for i, j in self.step_plan(iteration):
            s, s_next = step_sigmas(sig_dev, i, n, j)  # [n] each, on x's device
            v = velocity_batched(policy, x, s, cond, self.max_batch, counter)  # [n, C, H, W]
            if i in stoch:
                noise = seeded_randn(seeds, tuple(x.shape[1:]), stream=1 + i, device=x.device)
                out = step_fn(v, x, s, s_next, noise_level=self.noise_level, noise=noise)
                x0_prev = sig_prev = None  # a noisy step leaves the ODE trajectory: restart at first order
            elif self.ode_solver == "dpmpp_2m":
                si, sj = float(sigmas[i]), float(sigmas[j])
                x0 = data_prediction(x, v, si)  # [n, C, H, W]
                nxt = dpmpp_2m_step(x, x0, si, sj, x0_prev, sig_prev) if second_order(sig_prev, si, sj) else None
                out = ode_step(v, x, s, s_next, prev_sample=nxt)  # first order (nxt None): Euler itself
                x0_prev, sig_prev = x0, si
            else:
                out = ode_step(v, x, s, s_next)
            if i in trained:
                parts.append((i, Transitions(
                    latents=x, next_latents=out.sample, sigma=s, sigma_next=s_next,
                    prompt_index=prompt_index.clone(), sample_index=sample_index.clone(),
                    step=torch.full((n,), i, dtype=torch.long), old_log_prob=out.log_prob,
                    weight=torch.ones(n, device=x.device))))
            x = out.sample
        return x, parts
