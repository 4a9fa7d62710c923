"""Tree rollouts (BranchGRPO, Li et al. 2025, arXiv 2509.06040; docs/algorithms.md §4).

One tree per prompt: every active latent of a step gets one velocity evaluation, and at a
split step each latent spawns ``K`` children from the same step mean. With ``n_0 = 1`` and
``n_{i+1} = K n_i`` if ``i`` is a split step else ``n_i``, a tree costs ``sum_i n_i`` model
evaluations (203 for ``T = 20``, splits ``(0, 3, 6, 9)``, ``K = 2``; flat GRPO with 16 samples:
320) and has ``sum_i n_{i+1}`` edges (218), each a stored transition ``parent -> child``.

Node numbering: roots are nodes ``0..P-1``; the children made by step ``i`` follow, in the
order of the active rows (tree-major, then path order), so a node's parent always has a
smaller id, a subtree's leaves are contiguous, and leaf ``l`` is row ``l`` of ``Rollout.x0``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from ..seeding import derive_seeds, seeded_randn_rows
from ..sde import DEFAULT_NOISE_LEVEL, STEPS, get_step, ode_step
from ..structures import TreeStructure
from ..types import FlowPolicy, RewardFn, index_cond
from .base import Rollout, Transitions, score_images
from .common import EvalCounter, sampling_setup, step_sigmas, velocity_batched

MODES = ("sde", "mix")
_MAX_PATHS = 1 << 20  # active latents per tree and step, bounds the noise-stream encoding


def branch_noise(base: torch.Tensor, eta: torch.Tensor, mix: float) -> torch.Tensor:
    """Children's noise ``xi_b = (xi0 + s eta_b) / sqrt(1 + s^2)`` (BranchGRPO, arXiv 2509.06040).

    ``base`` [B, ...] is the draw ``xi0`` shared by siblings, ``eta`` [B, ...] each child's own
    draw, both standard normal: ``xi_b`` is exactly N(0, 1) per element, siblings have
    correlation ``1 / (1 + s^2)`` (0.059 at s = 4). So the step's own Gaussian density (same
    ``scale``) is the right ``log_prob`` of the child: unlike the public code, which scales
    the noise without changing the density.
    """
    return (base + mix * eta) / math.sqrt(1.0 + mix * mix)  # [B, ...]


def _stream(step: int, pos: torch.Tensor, kind: int) -> list[int]:
    """Distinct ``seeded_randn`` streams (>= 1; 0 is the initial noise) for (step, path, kind).

    ``pos`` [R] is a latent's index in its tree's active list (its path); kind 0: the step
    noise of a non-split latent or the shared draw ``xi0`` of a splitting parent; kind 1: a
    child's own draw ``eta_b`` (``pos`` = the child's index).
    """
    return [1 + 3 * (step * _MAX_PATHS + int(p)) + kind for p in pos.tolist()]


def _path_noise(seeds: list[int], streams: list[int], shape: tuple[int, ...], device) -> torch.Tensor:
    """Row r ~ N(0, 1) from (seeds[r], streams[r]) alone -> ``[R, *shape]`` float32, drawn on ``device``."""
    return seeded_randn_rows(seeds, streams, shape, device)  # [R, *shape]


@dataclass
class BranchSampler:
    """One branching tree per prompt (BranchGRPO, arXiv 2509.06040), all trees batched per step.

    Args:
        num_steps: denoising steps T.
        split_steps: steps ``i`` (0-based, strictly increasing, in ``[0, T)``) where every
            active latent spawns ``branch_factor`` children; paper default ``(0, 3, 6, 9)``.
        branch_factor: children per split K (>= 2); a tree has ``K ** len(split_steps)`` leaves.
        step: stochastic step type of ``flowrl.sde.STEPS`` (``"dance"``, ``"sde"``, ``"cps"``).
        noise_level: the step's noise parameter; None takes the step's default (0.3 for dance).
        branch_noise_mix: ``s`` of :func:`branch_noise` (paper: 4), > 0; larger = more
            independent siblings (0 would make all children of a split identical).
        mode: ``"sde"`` (every step stochastic and stored) or ``"mix"`` (BranchGRPO-Mix: SDE at
            the split steps plus a window of ``window`` steps, ODE elsewhere; only SDE edges
            are stored).
        window, window_start, window_shift_every: the mix-mode window: ``window`` consecutive
            steps from ``window_start``, sliding one step every ``window_shift_every``
            iterations (wrapping around), fixed if None.
        max_batch: chunk velocity calls to at most this many rows (memory), None = all.
    """

    num_steps: int = 20
    split_steps: Sequence[int] = (0, 3, 6, 9)
    branch_factor: int = 2
    step: str = "dance"
    noise_level: Optional[float] = None
    branch_noise_mix: float = 4.0
    mode: str = "sde"
    window: int = 4
    window_start: int = 0
    window_shift_every: Optional[int] = None
    max_batch: Optional[int] = None
    stores_transitions: ClassVar[bool] = True  # every tree edge of a stochastic step

    def __post_init__(self) -> None:
        get_step(self.step)
        if self.step == "ode":
            raise ValueError(f"BranchSampler needs a stochastic step (one of {sorted(set(STEPS) - {'ode'})}); "
                             "'ode' cannot branch and has no log-probabilities to train on")
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {self.num_steps!r}")
        splits = tuple(self.split_steps) if not isinstance(self.split_steps, int) else (self.split_steps,)
        if not splits:
            raise ValueError("split_steps is empty: a tree needs at least one split step to have more than "
                             "one leaf (paper default (0, 3, 6, 9))")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in splits):
            raise ValueError(f"split_steps must be integers, got {splits!r}")
        if any(i < 0 or i >= self.num_steps for i in splits):
            raise ValueError(f"split_steps must lie in [0, num_steps - 1] = [0, {self.num_steps - 1}], got {splits}")
        if len(set(splits)) != len(splits):
            raise ValueError(f"split_steps has duplicates: {splits}; list each split step once")
        if list(splits) != sorted(splits):
            raise ValueError(f"split_steps must be sorted increasingly, got {splits}; e.g. {tuple(sorted(splits))}")
        self.split_steps = splits
        if not isinstance(self.branch_factor, int) or self.branch_factor < 2:
            raise ValueError(f"branch_factor must be an integer >= 2 (K children per split), "
                             f"got {self.branch_factor!r}")
        if self.branch_factor ** len(splits) > _MAX_PATHS:
            raise ValueError(f"branch_factor ** len(split_steps) = {self.branch_factor ** len(splits)} leaves per "
                             f"tree exceeds {_MAX_PATHS}; use fewer split steps or a smaller branch_factor")
        if self.noise_level is None:
            self.noise_level = DEFAULT_NOISE_LEVEL[self.step]
        if not self.noise_level > 0:
            raise ValueError(f"noise_level must be > 0 (children of a split differ only by noise), "
                             f"got {self.noise_level}")
        if not self.branch_noise_mix > 0:
            raise ValueError(f"branch_noise_mix must be > 0 (paper: 4.0; 0 makes the children of a split "
                             f"identical), got {self.branch_noise_mix}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {MODES} ('mix' = BranchGRPO-Mix)")
        if not isinstance(self.window, int) or not 1 <= self.window <= self.num_steps:
            raise ValueError(f"window must be an integer in [1, num_steps={self.num_steps}], got {self.window!r}")
        if not isinstance(self.window_start, int) or not 0 <= self.window_start < self.num_steps:
            raise ValueError(f"window_start must be in [0, num_steps={self.num_steps}), got {self.window_start!r}")
        if self.window_shift_every is not None and self.window_shift_every < 1:
            raise ValueError(f"window_shift_every must be >= 1 or None, got {self.window_shift_every}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {self.max_batch}")

    # --- counts and schedule ---------------------------------------------------------------
    def active_counts(self) -> list[int]:
        """``n_i``, active latents per tree before step i, for i = 0..T (``n_T`` = leaves)."""
        n = [1]
        for i in range(self.num_steps):
            n.append(n[-1] * (self.branch_factor if i in self.split_steps else 1))
        return n

    @property
    def num_leaves(self) -> int:
        return self.branch_factor ** len(self.split_steps)

    @property
    def samples_per_prompt(self) -> int:
        """Finished samples (leaves) per prompt: the trainer's batch unit."""
        return self.num_leaves

    def check_available(self) -> None:
        """Nothing to check: this sampler runs wherever the policy runs (the Sampler protocol)."""

    def sde_steps(self, iteration: int = 0) -> list[int]:
        """Stochastic (stored) steps at this iteration: all in mode "sde"; splits + window in "mix"."""
        if self.mode == "sde":
            return list(range(self.num_steps))
        span = self.num_steps - self.window + 1
        start = self.window_start + (iteration // self.window_shift_every if self.window_shift_every else 0)
        start %= span
        return sorted(set(self.split_steps) | set(range(start, start + self.window)))

    def evals_per_tree(self) -> int:
        """Model evaluations per tree, ``sum_i n_i`` (docs/algorithms.md §4)."""
        return sum(self.active_counts()[:-1])

    def edges_per_tree(self, iteration: int = 0) -> int:
        """Stored transitions per tree, ``sum over stochastic i of n_{i+1}``."""
        n = self.active_counts()
        return sum(n[i + 1] for i in self.sde_steps(iteration))

    # --- sampling --------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, policy: FlowPolicy, prompts: list[str], reward: Optional[RewardFn] = None,
                 seed: int = 0, *, iteration: int = 0, seeds: Optional[list[int]] = None) -> Rollout:
        """Grow one tree per prompt; ``seeds`` (one per prompt) overrides the derived tree seeds.

        Every random draw of a tree depends only on its seed and the node's path, so a tree
        is the same whatever other prompts share the batch.
        """
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        t0 = time.perf_counter()
        p, k = len(prompts), self.branch_factor
        tree_seeds = list(seeds) if seeds is not None else derive_seeds(seed, p)
        if len(tree_seeds) != p:
            raise ValueError(f"got {len(tree_seeds)} seeds for {p} prompts (one seed per tree)")
        cond = policy.encode_prompts(list(prompts))  # per prompt [P, ...]
        x, sigmas, sig_dev = sampling_setup(policy, tree_seeds, self.num_steps)  # [P, C, H, W], [T + 1] CPU / device
        shape, dev = tuple(x.shape[1:]), x.device
        splits, stoch = set(self.split_steps), set(self.sde_steps(iteration))
        step_fn = get_step(self.step)
        counter = EvalCounter()

        tree = torch.arange(p)            # [R] tree of each active latent (non-decreasing)
        tree_d = torch.arange(p, device=dev)  # [R] the same on x's device (conditioning rows)
        pos = torch.zeros(p, dtype=torch.long)  # [R] index in its tree's active list (= path)
        node = torch.arange(p)            # [R] node id of each active latent
        parent, depth, node_tree = [torch.full((p,), -1)], [torch.zeros(p, dtype=torch.long)], [tree.clone()]
        node_lp, node_edge = [torch.zeros(p, device=dev)], [torch.full((p,), -1)]
        n_nodes, n_edges, parts = p, 0, []
        for i in range(self.num_steps):
            r = x.shape[0]
            s, s_next = step_sigmas(sig_dev, i, r)  # [R], [R] on x's device
            v = velocity_batched(policy, x, s, index_cond(cond, tree_d), self.max_batch, counter)  # [R, C, H, W]
            row_seeds = [tree_seeds[t] for t in tree.tolist()]
            if i in splits:
                rep = torch.arange(r).repeat_interleave(k)  # [R*K] parent row of each child (host index)
                rep_d = torch.arange(r, device=dev).repeat_interleave(k)  # [R*K] the same, built on x's device
                child_pos = pos[rep] * k + torch.arange(k).repeat(r)  # [R*K]
                xi0 = _path_noise(row_seeds, _stream(i, pos, 0), shape, dev)  # [R, C, H, W]
                eta = _path_noise([row_seeds[j] for j in rep.tolist()], _stream(i, child_pos, 1), shape, dev)
                noise = branch_noise(xi0[rep_d], eta, self.branch_noise_mix)  # [R*K, C, H, W]
                x_in, s_in, sn_in, tree_d = x[rep_d], s[rep_d], s_next[rep_d], tree_d[rep_d]  # [R*K, ...]
                out = step_fn(v[rep_d], x_in, s_in, sn_in, noise_level=self.noise_level, noise=noise)
            else:
                rep, child_pos, x_in, s_in, sn_in = torch.arange(r), pos, x, s, s_next
                if i in stoch:
                    noise = _path_noise(row_seeds, _stream(i, pos, 0), shape, dev)  # [R, C, H, W]
                    out = step_fn(v, x, s, s_next, noise_level=self.noise_level, noise=noise)
                else:
                    out = ode_step(v, x, s, s_next)
            c = rep.numel()
            ids = torch.arange(n_nodes, n_nodes + c)  # [C] the new child nodes
            parent.append(node[rep])
            depth.append(torch.full((c,), i + 1, dtype=torch.long))
            node_tree.append(tree[rep])
            node_lp.append(out.log_prob)  # [C], on x's device until the tree is done
            if i in stoch:  # stored where they were made: no per-step copy to the host
                node_edge.append(torch.arange(n_edges, n_edges + c))
                parts.append(Transitions(
                    latents=x_in, next_latents=out.sample, sigma=s_in, sigma_next=sn_in,
                    prompt_index=tree[rep].clone(), sample_index=torch.full((c,), -1),
                    step=torch.full((c,), i, dtype=torch.long), old_log_prob=out.log_prob,
                    weight=torch.ones(c, device=dev)))
                n_edges += c
            else:
                node_edge.append(torch.full((c,), -1))
            x, tree, pos, node = out.sample, tree[rep], child_pos, ids
            n_nodes += c
        t_roll = time.perf_counter() - t0

        images = policy.decode(x).float().cpu()  # [N, 3, H, W], leaves only, each once
        rewards, comps = score_images(reward, images, [prompts[t] for t in tree.tolist()])
        layout = TreeStructure.from_tree(
            torch.cat(parent), torch.cat(depth), torch.cat(node_tree), torch.cat(node_lp).cpu(),  # one copy to the host
            torch.cat(node_edge), node, n_edges, tree_seeds=tree_seeds, split_steps=self.split_steps,
            branch_factor=self.branch_factor, num_steps=self.num_steps, sde_steps=self.sde_steps(iteration),
            mode=self.mode)
        trans = Transitions.concat(parts) if parts else Transitions.empty(shape)
        leaf_lo, leaf_hi = layout.node_leaf_start, layout.node_leaf_end  # [nodes]
        single = (leaf_hi - leaf_lo) == 1  # [nodes] node leads to exactly one leaf
        en = layout.edge_node  # [M]
        trans.sample_index = torch.where(single[en], leaf_lo[en], torch.full_like(en, -1))  # [M]
        return Rollout(
            prompts=list(prompts), prompt_index=tree.clone(),
            seeds=torch.tensor([tree_seeds[t] for t in tree.tolist()], dtype=torch.long),
            group_index=tree.clone(), x0=x, images=images, rewards=rewards, transitions=trans,
            sigmas=sigmas, step_type=self.step, noise_level=float(self.noise_level),
            layout=layout, reward_components=comps, cond=cond,
            stats={"model_evals": counter.rows, "velocity_calls": counter.calls, "rollout_seconds": t_roll,
                   "reward_seconds": time.perf_counter() - t0 - t_roll, "tree_nodes": n_nodes,
                   "tree_edges": n_edges})
