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
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, NamedTuple, Optional, Sequence, Union

import torch

from ..conditions import encode_conditions
from ..options import AtLeast, NonNegativeInt, PositiveInt, check_fields
from ..seeding import derive_seeds, seeded_randn_rows
from ..sde import DEFAULT_NOISE_LEVEL, STEPS, get_step, ode_step
from ..structures import TreeStructure
from ..types import FlowPolicy, RewardFn, index_cond
from .base import Rollout, SamplerDeclarations, Transitions
from .common import EvalCounter, sampling_setup, step_sigmas, velocity_batched
from ..scoring import ChunkScorer, unit_chunks

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


class _Step(NamedTuple):
    """One step of all trees: the rows that went in (a splitting parent repeated K times) and
    the step's output, ``C`` rows each (``C = R K`` at a split step, else ``R``)."""

    rep: torch.Tensor       # [C] parent row of each child (host index)
    pos: torch.Tensor       # [C] each child's index in its tree's active list (= path)
    x_in: torch.Tensor      # [C, ...] latent each child was stepped from
    s_in: torch.Tensor      # [C] sigma_i
    sn_in: torch.Tensor     # [C] sigma_{i+1}
    tree_d: torch.Tensor    # [C] tree of each child on x's device (conditioning rows)
    out: object             # the step's output: ``.sample`` [C, ...], ``.log_prob`` [C]


@dataclass
class _TreeLog:
    """Node and edge records of the growing trees, one list entry per step (roots first).

    Per node: ``parent`` (-1 for a root), ``depth``, ``node_tree``, ``node_edge`` (its incoming
    stored edge, -1 if none), host long tensors; ``node_lp`` the log-prob of its incoming step
    (0 for a root), kept on x's device until the trees are done. ``parts`` holds the stored
    transitions (stochastic steps only), where they were made.
    """

    parent: list = field(default_factory=list)
    depth: list = field(default_factory=list)
    node_tree: list = field(default_factory=list)
    node_lp: list = field(default_factory=list)
    node_edge: list = field(default_factory=list)
    parts: list = field(default_factory=list)
    n_nodes: int = 0
    n_edges: int = 0

    @classmethod
    def roots(cls, trees: torch.Tensor, device) -> "_TreeLog":
        """One root per tree of ``trees`` [p] (nodes ``0..p-1``)."""
        p = trees.numel()
        return cls(parent=[torch.full((p,), -1)], depth=[torch.zeros(p, dtype=torch.long)],
                   node_tree=[trees.clone()], node_lp=[torch.zeros(p, device=device)],
                   node_edge=[torch.full((p,), -1)], n_nodes=p)

    @classmethod
    def merge(cls, logs: list["_TreeLog"], firsts: list[int], per_tree: list[int], stored: list[int]) -> "_TreeLog":
        """The log of all trees from the logs of consecutive tree chunks (chunk ``k`` holds trees
        ``firsts[k]...``), renumbered as if all had grown together: node ids entry-major (roots, then
        the children of each step), tree-major within an entry. ``per_tree[e]`` is the nodes per
        tree of entry ``e``; ``stored`` the entries whose incoming edges are stored (edge ids alike)."""
        p = sum(log.node_tree[0].numel() for log in logs)
        edges_per_tree = [per_tree[e] for e in stored]
        out = cls(n_nodes=sum(log.n_nodes for log in logs), n_edges=sum(log.n_edges for log in logs))
        for e in range(len(per_tree)):
            for log, a in zip(logs, firsts):
                c = log.node_tree[0].numel()
                out.parent.append(_renumber(log.parent[e], c, a, p, per_tree))
                out.node_edge.append(_renumber(log.node_edge[e], c, a, p, edges_per_tree))
                out.depth.append(log.depth[e])
                out.node_tree.append(log.node_tree[e])
                out.node_lp.append(log.node_lp[e])
        out.parts = [Transitions.concat([log.parts[k] for log in logs]) if len(logs) > 1 else logs[0].parts[k]
                     for k in range(len(stored))]
        return out

    def add_children(self, i: int, node: torch.Tensor, tree: torch.Tensor, st: _Step, stored: bool) -> torch.Tensor:
        """Record the children made by step ``i`` (parents ``node[st.rep]``); ``stored``: the step
        is stochastic and its edges become transitions. Returns the new node ids ``[C]``."""
        c = st.rep.numel()
        ids = torch.arange(self.n_nodes, self.n_nodes + c)  # [C] the new child nodes
        self.parent.append(node[st.rep])
        self.depth.append(torch.full((c,), i + 1, dtype=torch.long))
        self.node_tree.append(tree[st.rep])
        self.node_lp.append(st.out.log_prob)  # [C], on x's device until the tree is done
        if stored:  # stored where they were made: no per-step copy to the host
            self.node_edge.append(torch.arange(self.n_edges, self.n_edges + c))
            self.parts.append(Transitions(
                latents=st.x_in, next_latents=st.out.sample, sigma=st.s_in, sigma_next=st.sn_in,
                prompt_index=tree[st.rep].clone(), sample_index=torch.full((c,), -1),
                step=torch.full((c,), i, dtype=torch.long), old_log_prob=st.out.log_prob,
                weight=torch.ones(c, device=st.x_in.device)))
            self.n_edges += c
        else:
            self.node_edge.append(torch.full((c,), -1))
        self.n_nodes += c
        return ids


def _renumber(ids: torch.Tensor, c: int, a: int, p: int, sizes: list[int]) -> torch.Tensor:
    """Ids [n] numbered entry-major within a chunk of ``c`` trees starting at tree ``a`` (``sizes[e]`` ids per
    tree in entry ``e``; -1 kept) -> the same ids numbered among all ``p`` trees."""
    if not sizes or ids.numel() == 0 or (ids < 0).all():
        return ids
    cum = torch.tensor([0] + list(sizes)).cumsum(0)  # [E + 1] ids per tree before each entry
    e = (torch.searchsorted(c * cum[:-1], ids, right=True) - 1).clamp(min=0)  # [n] entry of each id
    q = ids - c * cum[e]  # [n] position within the chunk's entry
    return torch.where(ids >= 0, p * cum[e] + a * torch.tensor(list(sizes))[e] + q, ids)  # [n]


@dataclass
class BranchSampler(SamplerDeclarations):
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
        max_batch: chunk velocity calls to at most this many rows (memory), None = all; the
            trees also grow in chunks of ``max_batch // leaves`` (at least one), each chunk's leaves
            scored while the next chunk grows.
    """

    num_steps: PositiveInt = 20
    split_steps: Union[NonNegativeInt, Sequence[NonNegativeInt]] = (0, 3, 6, 9)
    branch_factor: Annotated[int, AtLeast(2, why="K children per split")] = 2
    step: str = "dance"
    noise_level: Optional[Annotated[float, AtLeast(0, strict=True, why="children of a split differ only by noise")]] \
        = None
    branch_noise_mix: Annotated[float, AtLeast(0, strict=True, why="paper: 4.0; 0 makes the children of a split "
                                                                   "identical")] = 4.0
    mode: Literal[MODES] = "sde"
    window: PositiveInt = 4
    window_start: NonNegativeInt = 0
    window_shift_every: Optional[PositiveInt] = None
    max_batch: Optional[PositiveInt] = None
    stores_transitions: ClassVar[bool] = True  # every tree edge of a stochastic step
    flat_groups: ClassVar[bool] = False  # an edge leads to several finished samples (Needs.flat_groups)

    def __post_init__(self) -> None:
        check_fields(self)  # the declared types and ranges (flowrl.options)
        get_step(self.step)
        if self.step == "ode":
            raise ValueError(f"BranchSampler needs a stochastic step (one of {sorted(set(STEPS) - {'ode'})}); "
                             "'ode' cannot branch and has no log-probabilities to train on")
        splits = tuple(self.split_steps) if not isinstance(self.split_steps, int) else (self.split_steps,)
        if not splits:
            raise ValueError("split_steps is empty: a tree needs at least one split step to have more than "
                             "one leaf (paper default (0, 3, 6, 9))")
        if any(i >= self.num_steps for i in splits):
            raise ValueError(f"split_steps must lie in [0, num_steps - 1] = [0, {self.num_steps - 1}], got {splits}")
        if len(set(splits)) != len(splits):
            raise ValueError(f"split_steps has duplicates: {splits}; list each split step once")
        if list(splits) != sorted(splits):
            raise ValueError(f"split_steps must be sorted increasingly, got {splits}; e.g. {tuple(sorted(splits))}")
        self.split_steps = splits
        if self.branch_factor ** len(splits) > _MAX_PATHS:
            raise ValueError(f"branch_factor ** len(split_steps) = {self.branch_factor ** len(splits)} leaves per "
                             f"tree exceeds {_MAX_PATHS}; use fewer split steps or a smaller branch_factor")
        if self.noise_level is None:
            self.noise_level = DEFAULT_NOISE_LEVEL[self.step]
        if self.window > self.num_steps:
            raise ValueError(f"window must be an integer in [1, num_steps={self.num_steps}], got {self.window!r}")
        if self.window_start >= self.num_steps:
            raise ValueError(f"window_start must be in [0, num_steps={self.num_steps}), got {self.window_start!r}")

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

    def smoke_options(self) -> dict:
        """3 steps, splits at the first two, a window of 2 from the start."""
        return {"num_steps": 3, "split_steps": [0, 1], "window": 2, "window_start": 0, "max_batch": None}

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
        p = len(prompts)
        tree_seeds = list(seeds) if seeds is not None else derive_seeds(seed, p)
        if len(tree_seeds) != p:
            raise ValueError(f"got {len(tree_seeds)} seeds for {p} prompts (one seed per tree)")
        cond = encode_conditions(policy, list(prompts))  # per prompt [P, ...]
        x, sigmas, sig_dev = sampling_setup(policy, tree_seeds, self.num_steps)  # [P, C, H, W], [T + 1] CPU / device
        shape = tuple(x.shape[1:])
        counts = self.active_counts()  # nodes per tree of each log entry (roots, then each step's children)
        stored = [i + 1 for i in range(self.num_steps) if i in set(self.sde_steps(iteration))]
        counter = EvalCounter()
        leaves, trees, nodes, logs, firsts, images = [], [], [], [], [], []
        with ChunkScorer(reward) as scorer:
            for ts in unit_chunks(p, self.num_leaves, self.max_batch):  # whole trees, scored while the next grow
                c = ts.stop - ts.start
                xc, tree, node, log = self._grow(policy, {k: v[ts] for k, v in cond.items()}, x[ts], sig_dev,
                                                 tree_seeds, iteration, torch.arange(ts.start, ts.stop), counter)
                leaves.append(xc)
                trees.append(tree)
                nodes.append(_renumber(node, c, ts.start, p, counts))
                logs.append(log)
                firsts.append(ts.start)
                images.append(policy.decode(xc).float().cpu())  # [n_c, 3, H, W], leaves only, each once
                scorer.submit(images[-1], [prompts[t] for t in tree.tolist()])
            scores = scorer.result()
        x, tree, node = torch.cat(leaves), torch.cat(trees), torch.cat(nodes)  # [N, C, H, W], [N], [N]
        log = _TreeLog.merge(logs, firsts, counts, stored)
        layout = TreeStructure.from_tree(
            torch.cat(log.parent), torch.cat(log.depth), torch.cat(log.node_tree),
            torch.cat(log.node_lp).cpu(),  # one copy to the host
            torch.cat(log.node_edge), node, log.n_edges, tree_seeds=tree_seeds, split_steps=self.split_steps,
            branch_factor=self.branch_factor, num_steps=self.num_steps, sde_steps=self.sde_steps(iteration),
            mode=self.mode)
        trans = Transitions.concat(log.parts) if log.parts else Transitions.empty(shape)
        trans.sample_index = _leaf_sample_index(layout)  # [M]
        return Rollout(
            prompts=list(prompts), prompt_index=tree.clone(),
            seeds=torch.tensor([tree_seeds[t] for t in tree.tolist()], dtype=torch.long),
            group_index=tree.clone(), x0=x, images=torch.cat(images), rewards=scores.rewards, transitions=trans,
            sigmas=sigmas, step_type=self.step, noise_level=float(self.noise_level),
            layout=layout, reward_components=scores.components, cond=cond,
            stats={"model_evals": counter.rows, "velocity_calls": counter.calls,
                   "rollout_seconds": time.perf_counter() - t0 - scores.wait_seconds, **scores.stats(),
                   "tree_nodes": log.n_nodes, "tree_edges": log.n_edges})

    # --- steps of __call__ -----------------------------------------------------------------
    def _grow(self, policy: FlowPolicy, cond, x: torch.Tensor, sig_dev: torch.Tensor, tree_seeds: list[int],
              iteration: int, trees: torch.Tensor, counter: EvalCounter
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _TreeLog]:
        """Run the T steps of the trees ``trees`` [p] (a chunk), one batched velocity call per step.

        ``x`` [p, C, H, W] are the roots' initial noises, ``cond`` [p, ...] their conditioning,
        ``tree_seeds`` every tree's seed. Returns ``(leaves [n, C, H, W], tree [n], leaf node ids [n],
        log)``, leaves tree-major in path order, node ids numbered within the chunk.
        """
        p, dev = x.shape[0], x.device
        splits, stoch = set(self.split_steps), set(self.sde_steps(iteration))
        tree = trees.clone()              # [R] tree of each active latent (non-decreasing)
        tree_d = torch.arange(p, device=dev)  # [R] its row of the chunk's conditioning, on x's device
        pos = torch.zeros(p, dtype=torch.long)  # [R] index in its tree's active list (= path)
        node = torch.arange(p)            # [R] node id of each active latent
        log = _TreeLog.roots(trees, dev)
        for i in range(self.num_steps):
            s, s_next = step_sigmas(sig_dev, i, x.shape[0])  # [R], [R] on x's device
            v = velocity_batched(policy, x, s, index_cond(cond, tree_d), self.max_batch, counter)  # [R, C, H, W]
            row_seeds = [tree_seeds[t] for t in tree.tolist()]
            if i in splits:
                st = self._split_step(i, v, x, s, s_next, pos, tree_d, row_seeds)
            else:
                st = self._plain_step(i, v, x, s, s_next, pos, tree_d, row_seeds, stochastic=i in stoch)
            node = log.add_children(i, node, tree, st, stored=i in stoch)
            x, tree, pos, tree_d = st.out.sample, tree[st.rep], st.pos, st.tree_d
        return x, tree, node, log

    def _split_step(self, i: int, v: torch.Tensor, x: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor,
                    pos: torch.Tensor, tree_d: torch.Tensor, row_seeds: list[int]) -> _Step:
        """Split step ``i``: each of the R active latents spawns K children from its step mean.

        Child ``b`` of a parent draws ``xi0`` (shared by siblings, stream of the parent's path)
        and its own ``eta_b`` (stream of the child's path), mixed by :func:`branch_noise`.
        """
        r, k = x.shape[0], self.branch_factor
        shape, dev = tuple(x.shape[1:]), x.device
        rep = torch.arange(r).repeat_interleave(k)  # [R*K] parent row of each child (host index)
        rep_d = torch.arange(r, device=dev).repeat_interleave(k)  # [R*K] the same, built on x's device
        child_pos = pos[rep] * k + torch.arange(k).repeat(r)  # [R*K]
        xi0 = _path_noise(row_seeds, _stream(i, pos, 0), shape, dev)  # [R, C, H, W]
        eta = _path_noise([row_seeds[j] for j in rep.tolist()], _stream(i, child_pos, 1), shape, dev)
        noise = branch_noise(xi0[rep_d], eta, self.branch_noise_mix)  # [R*K, C, H, W]
        x_in, s_in, sn_in = x[rep_d], s[rep_d], s_next[rep_d]  # [R*K, ...]
        out = get_step(self.step)(v[rep_d], x_in, s_in, sn_in, noise_level=self.noise_level, noise=noise)
        return _Step(rep, child_pos, x_in, s_in, sn_in, tree_d[rep_d], out)

    def _plain_step(self, i: int, v: torch.Tensor, x: torch.Tensor, s: torch.Tensor, s_next: torch.Tensor,
                    pos: torch.Tensor, tree_d: torch.Tensor, row_seeds: list[int], stochastic: bool) -> _Step:
        """Non-split step ``i``: each active latent moves one step (``self.step`` with the noise
        of its path if ``stochastic``, else ODE), keeping its row and path."""
        if stochastic:
            noise = _path_noise(row_seeds, _stream(i, pos, 0), tuple(x.shape[1:]), x.device)  # [R, C, H, W]
            out = get_step(self.step)(v, x, s, s_next, noise_level=self.noise_level, noise=noise)
        else:
            out = ode_step(v, x, s, s_next)
        return _Step(torch.arange(x.shape[0]), pos, x, s, s_next, tree_d, out)


def _leaf_sample_index(layout: TreeStructure) -> torch.Tensor:
    """``[M]`` long: the leaf (sample) an edge leads to when its child has exactly one leaf below
    it, else -1 (the edge's reward is a fused one, not a single sample's)."""
    leaf_lo, leaf_hi = layout.node_leaf_start, layout.node_leaf_end  # [nodes]
    single = (leaf_hi - leaf_lo) == 1  # [nodes] node leads to exactly one leaf
    en = layout.edge_node  # [M]
    return torch.where(single[en], leaf_lo[en], torch.full_like(en, -1))  # [M]
