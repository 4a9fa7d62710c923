"""TempFlow-GRPO rollouts: process rewards by branching off an ODE trajectory (docs/algorithms.md §5).

TempFlow-GRPO (He et al. 2025, arXiv 2508.04324): for every (prompt, seed) a **main
trajectory** runs pure ODE (Euler) from the seed's initial noise. At each branch step ``k``
it spawns ``branches`` children with one Flow-GRPO SDE step from the main latent ``x_k``
(same mean, independent noise), and each child is **completed by ODE** to ``x0``, decoded
and scored. The completion's reward is the process reward ``R[b, k]`` of the single
stochastic transition ``x_k -> child b``, the only transition stored for it.

Batching: at step ``i`` the main latents and every live completion (children of all branch
steps ``k < i``, all seeds, all prompts) go through the model as one batch (chunked by
``max_batch``). All completions reach ``x0`` at the last step together and are decoded and
scored. With ``max_batch`` the main trajectories run in chunks of ``max_batch // (E |B|)`` (at
least one), each chunk's completions scored while the next chunk samples.

Model evaluations (latent rows through ``policy.velocity``), per (prompt, seed)::

    T_main + branches * sum_{k in B} (T - 1 - k)

with ``T_main = T`` if ``finish_main`` else ``max(B) + 1`` (the main trajectory stops after
the last branch step; its ``x0`` is not a sample). The child's SDE step from ``x_k``
**reuses** the main trajectory's velocity at ``x_k`` (same latent, sigma and prompt, so the
same value), so a child only costs its ODE completion steps ``k + 1 .. T - 1``. For docs/algorithms.md's
T = 10, B = 0..8, E = 6 with ``finish_main``: 10 + 6 * 45 = 280 (docs/algorithms.md: "10 main + 6 *
sum(9 - k)"); without: 9 + 270 = 279.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Optional, Sequence

import torch

from ..advantages.tempflow import GROUP_BY, prompt_text_ids
from ..conditions import encode_conditions
from ..noise import noise_aware_weights
from ..options import AtLeast, Between, NonNegativeInt, PositiveInt, check_fields
from ..sde import ode_step, sde_step
from ..seeding import derive_seeds, seeded_randn
from ..structures import TempFlowStructure
from ..types import FlowPolicy, RewardFn, index_cond
from .base import Rollout, SamplerDeclarations, Transitions
from .common import EvalCounter, sampling_setup, step_sigmas, velocity_batched
from ..scoring import ChunkScorer, unit_chunks

MAX_BRANCHES = 1000  # noise streams are 1 + 1000 k + b (unique per (k, b), see branch_noise_stream)


def branch_noise_stream(step: int, branch: int) -> int:
    """``flowrl.seeding`` stream of child ``branch`` at branch step ``step``: ``1 + 1000 k + b``.

    Depends on (k, b) only (not on T, the branch list or the branch count), so with the
    seed, a child's noise is the same whatever the configuration around it. Distinct
    (seed, stream) pairs give distinct generators while streams stay below 1,000,003
    (``seeded_randn``'s seed multiplier), i.e. for k, b < 1000.
    """
    return 1 + MAX_BRANCHES * int(step) + int(branch)


@dataclass
class TempFlowSampler(SamplerDeclarations):
    """TempFlow-GRPO sampler: ``seeds_per_prompt`` ODE trajectories per prompt, ``branches``
    SDE children at every branch step, each completed by ODE and scored.

    Args:
        num_steps: denoising steps T.
        branch_steps: steps ``k`` that branch (and are trained); None = every step but the
            last, ``range(T - 1)`` (the TempFlow-GRPO code branches at every trained step).
            Given in any order; stored sorted as a tuple.
        branches: SDE children per branch step and seed (E, paper/code default 6).
        seeds_per_prompt: initial noises per prompt (paper/code default 4).
        noise_level: Flow-GRPO's ``a`` of the branching SDE step (SD3: 0.7, FLUX: 0.9).
        noise_aware: put the noise-aware weight ``w_k`` (flowrl.advantages.tempflow.
            noise_aware_weights over ``branch_steps``) in ``transitions.weight``; else 1.
        group_by: advantage groups: ``"seed"`` = (prompt, seed, step), E per group;
            ``"prompt"`` = (prompt, step), ``seeds_per_prompt * E`` per group;
            ``"seed_tracker"`` / ``"prompt_tracker"``: the same groups (prompt text for
            ``prompt_tracker``) with the TempFlow-GRPO code's statistics
            (:func:`flowrl.advantages.tempflow.tracker_advantages`).
        finish_main: run the main trajectory to x0 too (T evaluations instead of
            ``max(B) + 1``) and report its ODE reward in ``layout.main_rewards`` [P * S].
        max_batch: chunk velocity calls to at most this many rows (memory), None = all.
    """

    num_steps: Annotated[int, Between(1, MAX_BRANCHES, why="per-branch noise streams")] = 10
    branch_steps: Optional[Sequence[NonNegativeInt]] = None
    branches: Annotated[int, Between(1, MAX_BRANCHES)] = 6
    seeds_per_prompt: PositiveInt = 4
    noise_level: Annotated[float, AtLeast(0, strict=True, why="the branching SDE step must inject noise")] = 0.7
    noise_aware: bool = True
    group_by: Literal[GROUP_BY] = "seed"
    finish_main: bool = False
    max_batch: Optional[PositiveInt] = None
    stores_transitions: ClassVar[bool] = True  # one branching SDE step per completion
    flat_groups: ClassVar[bool] = False  # completions share their trajectory's steps (Needs.flat_groups)

    def __post_init__(self) -> None:
        check_fields(self)  # the declared types and ranges (flowrl.options)
        if self.branch_steps is None:
            if self.num_steps < 2:
                raise ValueError("num_steps=1 leaves no step to branch by default (the last step is "
                                 "excluded); pass branch_steps=[0] explicitly or use num_steps >= 2")
            self.branch_steps = tuple(range(self.num_steps - 1))
        steps = list(self.branch_steps)
        if not steps:
            raise ValueError("branch_steps is empty: pass at least one step index (or None for range(T - 1))")
        if len(set(steps)) != len(steps):
            raise ValueError(f"branch_steps has duplicates: {steps}")
        bad = [k for k in steps if k >= self.num_steps]
        if bad:
            raise ValueError(f"branch_steps {bad} are outside [0, num_steps={self.num_steps})")
        self.branch_steps = tuple(sorted(steps))
        per_prompt = self.group_by in ("prompt", "prompt_tracker")
        group = self.branches * (self.seeds_per_prompt if per_prompt else 1)
        if group < 2:
            raise ValueError(f"an advantage group of group_by={self.group_by!r} holds {group} transition(s); "
                             f"it needs >= 2 (raise branches"
                             f"{' or seeds_per_prompt' if per_prompt else ''})")

    # --- closed forms ----------------------------------------------------------------------
    def main_evals(self) -> int:
        """Velocity rows of one main trajectory: T if ``finish_main`` else ``max(B) + 1``."""
        return self.num_steps if self.finish_main else max(self.branch_steps) + 1

    def model_evals(self, num_prompts: int) -> int:
        """Velocity rows of a whole rollout: ``P S (T_main + E sum_{k in B} (T - 1 - k))``
        (the child's SDE step reuses the main velocity at ``x_k``, see the module docstring)."""
        per_seed = self.main_evals() + self.branches * sum(self.num_steps - 1 - k for k in self.branch_steps)
        return num_prompts * self.seeds_per_prompt * per_seed

    def num_completions(self, num_prompts: int) -> int:
        """Samples (= stored transitions) of a rollout: ``P S E |B|``."""
        return num_prompts * self.seeds_per_prompt * self.branches * len(self.branch_steps)

    @property
    def samples_per_prompt(self) -> int:
        """Finished samples (completions) per prompt: the trainer's batch unit."""
        return self.num_completions(1)

    def smoke_options(self) -> dict:
        """One seed per prompt, 2 branches at the first two of 3 steps."""
        return {"num_steps": 3, "branch_steps": [0, 1], "branches": 2, "seeds_per_prompt": 1, "max_batch": None}

    def check_available(self) -> None:
        """Nothing to check: this sampler runs wherever the policy runs (the Sampler protocol)."""

    # --- sampling --------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, policy: FlowPolicy, prompts: list[str], reward: Optional[RewardFn] = None,
                 seed: int = 0, *, iteration: int = 0, seeds: Optional[list[int]] = None) -> Rollout:
        """Sample a TempFlow rollout for ``prompts``.

        ``seeds`` (``len(prompts) * seeds_per_prompt``, prompt-major) overrides the seeds
        derived from ``seed``. ``iteration`` is accepted for the sampler interface (unused).

        Samples (``x0``, ``images``, ``rewards`` [N], N = P S E |B|) are the completions, in
        (prompt, seed, step, branch) order; transition ``m`` is the branching step of
        completion ``m`` (``sample_index = arange(N)``). ``layout`` is a
        :class:`flowrl.structures.TempFlowStructure`: per transition ``trajectory`` (main row
        p * S + s), ``seed_slot`` (s), ``step`` (k), ``branch`` (b), all ``[M]`` long, plus
        ``group_by``, ``branch_steps``, ``step_weights`` [T] and ``main_rewards`` [P * S] (NaN
        unless ``finish_main``).
        """
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        t0 = time.perf_counter()
        p, s_per, t = len(prompts), self.seeds_per_prompt, self.num_steps
        branch_steps = list(self.branch_steps)
        j = p * s_per  # main trajectories
        main_prompt = torch.arange(p).repeat_interleave(s_per)  # [J]
        seeds = list(seeds) if seeds is not None else derive_seeds(seed, j)
        if len(seeds) != j:
            raise ValueError(f"got {len(seeds)} seeds for {p} prompts x {s_per} seeds_per_prompt = {j} trajectories")
        cond_p = encode_conditions(policy, list(prompts))  # P rows
        main, sigmas, sig_dev = sampling_setup(policy, seeds, t)  # [J, C, H, W], [T + 1] CPU / device
        if sigmas.shape != (t + 1,):
            raise ValueError(f"policy.sigmas({t}) returned shape {tuple(sigmas.shape)}, expected ({t + 1},)")
        step_w = self._step_weights(sigmas)  # [T]
        counter = EvalCounter()
        x0s, trans_parts, images = [], [], []
        completions = ChunkScorer(reward)
        main_scorer = ChunkScorer(reward if self.finish_main and reward is not None else None)
        with completions, main_scorer:
            # trajectories in chunks of at most max_batch completions: a chunk is scored while the next samples
            for js in unit_chunks(j, self.branches * len(branch_steps), self.max_batch):
                jc = js.stop - js.start
                main_c, live, parts = self._denoise(policy, cond_p, main[js], sig_dev, seeds[js], main_prompt[js],
                                                    step_w, counter)
                perm_c = self._completion_order(jc)[0]  # [n_c] the chunk's samples, (seed, step, branch) order
                x0s.append(live[perm_c.to(live.device)])  # [n_c, C, H, W], on x's device
                trans_parts.append(Transitions.concat(parts).select(perm_c))
                images.append(policy.decode(x0s[-1]).float().cpu())  # [n_c, 3, H, W]
                rows = main_prompt[js][self._completion_order(jc)[1]]  # [n_c] prompt of each sample
                completions.submit(images[-1], [prompts[q] for q in rows.tolist()])
                if self.finish_main and reward is not None:
                    main_scorer.submit(policy.decode(main_c).float().cpu(), [prompts[q] for q in main_prompt[js].tolist()])
            scores = completions.result()
            main_scores = main_scorer.result()

        perm, trajectory, step_of, branch = self._completion_order(j)  # [N] each
        x0 = torch.cat(x0s)  # [N, C, H, W], on x's device
        trans = Transitions.concat(trans_parts)
        trans.sample_index = torch.arange(perm.numel())
        prompt_index = main_prompt[trajectory]  # [N]
        seed_t = torch.tensor(seeds, dtype=torch.long)  # [J]
        main_rewards = main_scores.rewards if self.finish_main and reward is not None \
            else torch.full((j,), float("nan"))  # [J]
        wait = scores.wait_seconds + main_scores.wait_seconds
        return Rollout(
            prompts=list(prompts), prompt_index=prompt_index, seeds=seed_t[trajectory],
            group_index=self._group_index(prompts, trajectory, prompt_index, step_of),
            x0=x0, images=torch.cat(images), rewards=scores.rewards, transitions=trans, sigmas=sigmas,
            step_type="sde", noise_level=float(self.noise_level), reward_components=scores.components, cond=cond_p,
            layout=TempFlowStructure(trajectory=trajectory, seed_slot=trajectory % s_per, step=step_of, branch=branch,
                                     group_by=self.group_by, branch_steps=branch_steps, step_weights=step_w,
                                     main_rewards=main_rewards),
            stats={"model_evals": counter.rows, "velocity_calls": counter.calls,
                   "num_completions": float(perm.numel()), "rollout_seconds": time.perf_counter() - t0 - wait,
                   "reward_seconds": scores.seconds + main_scores.seconds, "reward_wait_seconds": wait})

    # --- steps of __call__ -----------------------------------------------------------------
    def _step_weights(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Loss weight per step ``[T]`` float32: noise-aware ``w_k`` on the branch steps (or 1
        there without ``noise_aware``), 0 on the other steps (they are not trained)."""
        branch_steps = list(self.branch_steps)
        if self.noise_aware:
            return noise_aware_weights(sigmas, self.noise_level, branch_steps)  # [T]
        return torch.zeros(self.num_steps).index_fill_(0, torch.tensor(branch_steps), 1.0)  # [T]

    def _denoise(self, policy: FlowPolicy, cond_p, main: torch.Tensor, sig_dev: torch.Tensor, seeds: list[int],
                 main_prompt: torch.Tensor, step_w: torch.Tensor, counter: EvalCounter
                 ) -> tuple[torch.Tensor, torch.Tensor, list[Transitions]]:
        """Run the T steps: main latents by ODE, children spawned at the branch steps, every
        live completion by ODE; one batched velocity call per step.

        ``main`` [J, C, H, W] are a chunk's main trajectories (``seeds``, ``main_prompt`` [J] theirs;
        ``cond_p`` every prompt's conditioning). Returns ``(main, live [L, C, H, W], parts)``: ``main`` after its
        ``main_evals()`` steps, ``live`` the completions at ``x0`` in (step, row, branch)
        order (blocks of J * E per branch step), ``parts`` the branching transitions of each
        branch step in the same order.
        """
        j, e = main.shape[0], self.branches
        shape, dev = tuple(main.shape[1:]), main.device
        live = main.new_zeros((0, *shape))  # [L, C, H, W] completions, blocks of J * E per branch step
        live_prompt = torch.zeros(0, dtype=torch.long, device=dev)  # [L] (conditioning rows, on x's device)
        main_prompt_d = main_prompt.to(dev)  # [J]
        rep = torch.arange(j).repeat_interleave(e)  # [J * E] main row of each child, (row, branch) order
        rep_d = rep.to(dev)  # [J * E]
        main_steps = self.main_evals()
        parts: list[Transitions] = []
        for i in range(self.num_steps):
            run_main = i < main_steps
            x = torch.cat([main, live]) if run_main else live  # [J + L or L, C, H, W]
            rows = torch.cat([main_prompt_d, live_prompt]) if run_main else live_prompt  # [B]
            if x.shape[0] == 0:
                continue
            s, s_next = step_sigmas(sig_dev, i, x.shape[0])  # [B], [B] on x's device
            v = velocity_batched(policy, x, s, index_cond(cond_p, rows), self.max_batch, counter)
            v = v.float()  # [B, C, H, W]
            nm = j if run_main else 0
            v_main, v_live = v[:nm], v[nm:]  # [J, ...], [L, ...]
            live = ode_step(v_live, live, s[nm:], s_next[nm:]).sample  # [L, C, H, W]
            if i in self.branch_steps:
                part = self._branch(i, main, v_main, s[:1], s_next[:1], seeds, main_prompt[rep], rep_d, step_w)
                parts.append(part)
                live = torch.cat([live, part.next_latents])  # children join at sigma_{i+1}
                live_prompt = torch.cat([live_prompt, main_prompt_d[rep_d]])
            if run_main:
                main = ode_step(v_main, main, s[:nm], s_next[:nm]).sample  # [J, C, H, W]
        return main, live, parts

    def _branch(self, i: int, main: torch.Tensor, v_main: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor,
                seeds: list[int], child_prompt: torch.Tensor, rep_d: torch.Tensor,
                step_w: torch.Tensor) -> Transitions:
        """E children of each main latent from one SDE step at branch step ``i``.

        The main velocity ``v_main`` [J, C, H, W] is reused (same latent, sigma, prompt). ``s``,
        ``s_next`` are ``[1]`` (sigma_i, sigma_{i+1}); ``child_prompt`` [J * E] the prompt of
        each child, ``rep_d`` [J * E] its main row on the latents' device. Child (row, b)
        draws its noise from ``(seeds[row], branch_noise_stream(i, b))``. Returns the
        ``J * E`` transitions, stored where they were made (no per-step copy to the host);
        their ``next_latents`` are the children at sigma_{i+1}.
        """
        j, e = main.shape[0], self.branches
        shape, dev = tuple(main.shape[1:]), main.device
        noise = torch.stack([seeded_randn(seeds, shape, stream=branch_noise_stream(i, b), device=dev)
                             for b in range(e)], dim=1).reshape(j * e, *shape)  # [J * E, C, H, W]
        x_k = main[rep_d]  # [J * E, C, H, W]
        out = sde_step(v_main[rep_d], x_k, s.expand(j * e), s_next.expand(j * e),
                       noise_level=self.noise_level, noise=noise)
        return Transitions(
            latents=x_k, next_latents=out.sample,
            sigma=s.expand(j * e).clone(), sigma_next=s_next.expand(j * e).clone(),
            prompt_index=child_prompt, sample_index=torch.zeros(j * e, dtype=torch.long),
            step=torch.full((j * e,), i, dtype=torch.long), old_log_prob=out.log_prob,
            weight=torch.full((j * e,), float(step_w[i]), device=dev))

    def _completion_order(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample order of the completions for ``j`` main trajectories.

        ``_denoise`` leaves them in (step, row, branch) order; samples are (row, step, branch)
        = (prompt, seed, step, branch). Returns ``(perm, trajectory, step, branch)``, all
        ``[N]`` long on the CPU: ``perm`` maps sample -> completion, the others give each
        sample's main row, branch step k and child b.
        """
        nb, e = len(self.branch_steps), self.branches
        perm = torch.arange(j * nb * e).view(nb, j, e).permute(1, 0, 2).reshape(-1)  # [N]
        rep = torch.arange(j).repeat_interleave(e)  # [J * E] main row of each child
        trajectory = rep.repeat(nb)[perm]  # [N] main row of each completion
        step_of = torch.tensor(list(self.branch_steps)).repeat_interleave(j * e)[perm]  # [N]
        branch = torch.arange(e).repeat(j).repeat(nb)[perm]  # [N]
        return perm, trajectory, step_of, branch

    def _group_index(self, prompts: list[str], trajectory: torch.Tensor, prompt_index: torch.Tensor,
                     step_of: torch.Tensor) -> torch.Tensor:
        """Dense advantage group id of every sample ``[N]`` long, by ``group_by``."""
        t = self.num_steps
        if self.group_by in ("seed", "seed_tracker"):
            group_index = trajectory * t + step_of  # [N] (prompt, seed, step)
        elif self.group_by == "prompt_tracker":
            group_index = prompt_text_ids(prompts, prompt_index) * t + step_of  # [N] (prompt text, step)
        else:
            group_index = prompt_index * t + step_of  # [N] (prompt, step)
        _, group_index = torch.unique(group_index, return_inverse=True)  # [N] dense ids
        return group_index
