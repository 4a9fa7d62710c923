"""Typed rollout structures: what an advantage function needs beyond a rollout's common fields.

A :class:`flowrl.rollout.Rollout` holds one record in ``rollout.layout``; its class attribute
``name`` is the key of ``flowrl.advantages.ADVANTAGES`` that turns the rollout into one advantage
per transition (``rollout.structure`` is that name). Records are frozen: a sampler builds one,
nothing edits it afterwards. All tensors are on the CPU.

Shapes: N finished samples, M stored transitions, P prompts, T steps, ``nodes`` tree nodes.

A new structure is a frozen dataclass subclassing :class:`Structure` with its own ``name``, plus
``flowrl.advantages.register(name, fn)``; ``fn`` reads the record with :func:`layout_of`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, TypeVar

import torch


@dataclass(frozen=True, eq=False)
class Structure:
    """Base of the structure records; ``name`` keys ``flowrl.advantages.ADVANTAGES``."""

    name: ClassVar[str] = ""
    made_by: ClassVar[str] = "a sampler"  # the sampler that builds it (for error messages)


@dataclass(frozen=True, eq=False)
class GroupStructure(Structure):
    """Flat groups (Flow-GRPO, DanceGRPO, MixGRPO, ODE samples): everything is in the common fields
    (``Rollout.group_index`` [N] and ``transitions.sample_index`` [M])."""

    name: ClassVar[str] = "group"
    made_by: ClassVar[str] = "GroupSampler"


@dataclass(frozen=True, eq=False)
class SolStructure(GroupStructure):
    """A Sol-RL rollout (:class:`flowrl.rollout.SolSampler`): trained as flat groups (``name`` is
    ``"group"``), plus the record of the quantized exploration that chose its seeds."""

    pool_seeds: torch.Tensor       # [P * pool_size] long, every explored seed, prompt-major
    explore_rewards: torch.Tensor  # [P * pool_size] float32, reward of each explored (quantized ODE) sample
    selected: torch.Tensor         # [P * keep] long, rows of the pool that were regenerated
    backend: str                   # quantization backend of the exploration copy

    made_by: ClassVar[str] = "SolSampler"


@dataclass(frozen=True, eq=False)
class TreeStructure(Structure):
    """One branching tree per prompt (BranchGRPO, :class:`flowrl.rollout.BranchSampler`).

    Roots are nodes ``0..P-1``; a node's parent has a smaller id; a subtree's leaves are
    contiguous; leaf ``l`` is sample ``l``. Build with :meth:`from_tree` (derives the rest).
    """

    name: ClassVar[str] = "branch"
    made_by: ClassVar[str] = "BranchSampler"

    node_parent: torch.Tensor       # [nodes] long, -1 for the roots
    node_depth: torch.Tensor        # [nodes] long, 0 root; a child of step i has depth i + 1
    node_step: torch.Tensor         # [nodes] long, step that created the node (-1 root)
    node_tree: torch.Tensor         # [nodes] long, tree (= prompt row)
    node_log_prob: torch.Tensor     # [nodes] float32, log-prob of the edge into the node (0: root/ODE)
    node_edge: torch.Tensor         # [nodes] long, stored transition into the node (-1: root/ODE)
    node_is_leaf: torch.Tensor      # [nodes] bool
    node_leaf_start: torch.Tensor   # [nodes] long, the node's leaves are samples [start, end)
    node_leaf_end: torch.Tensor     # [nodes] long
    leaf_node: torch.Tensor         # [N] long, node of each finished sample
    edge_node: torch.Tensor         # [M] long, child node of each stored transition
    edge_parent_node: torch.Tensor  # [M] long, parent node of each stored transition
    tree_seeds: torch.Tensor        # [P] long, seed of each tree
    split_steps: list[int]          # steps where every active latent branches
    branch_factor: int              # children per split K
    num_steps: int                  # denoising steps T
    sde_steps: list[int]            # stochastic (stored) steps of this rollout
    mode: str                       # "sde" or "mix" (BranchGRPO-Mix)

    @classmethod
    def from_tree(cls, parent: torch.Tensor, depth: torch.Tensor, node_tree: torch.Tensor,
                  node_log_prob: torch.Tensor, node_edge: torch.Tensor, leaf_node: torch.Tensor, n_edges: int, *,
                  tree_seeds: Sequence[int], split_steps: Sequence[int], branch_factor: int, num_steps: int,
                  sde_steps: Sequence[int], mode: str = "sde") -> "TreeStructure":
        """The record of a tree given per node ``parent``, ``depth``, ``node_tree``, ``node_log_prob``,
        ``node_edge`` (all [nodes]) and ``leaf_node`` [N]: leaf ranges and edge maps are derived."""
        n = parent.numel()
        leaves = torch.arange(leaf_node.numel())
        lo = torch.full((n,), leaf_node.numel(), dtype=torch.long)  # [nodes]
        hi = torch.zeros(n, dtype=torch.long)  # [nodes]
        cur, lid = leaf_node.clone(), leaves
        while cur.numel():  # walk every leaf up to its root: subtree leaf ranges [lo, hi)
            lo.scatter_reduce_(0, cur, lid, reduce="amin")
            hi.scatter_reduce_(0, cur, lid + 1, reduce="amax")
            up = parent[cur]
            keep = up >= 0
            cur, lid = up[keep], lid[keep]
        edge_node = torch.full((n_edges,), -1, dtype=torch.long)  # [M]
        has = node_edge >= 0
        edge_node[node_edge[has]] = torch.arange(n)[has]
        is_leaf = torch.zeros(n, dtype=torch.bool)  # [nodes]
        is_leaf[leaf_node] = True
        return cls(node_parent=parent, node_depth=depth, node_step=depth - 1, node_tree=node_tree,
                   node_log_prob=node_log_prob, node_edge=node_edge, node_is_leaf=is_leaf, node_leaf_start=lo,
                   node_leaf_end=hi, leaf_node=leaf_node.clone(), edge_node=edge_node,
                   edge_parent_node=parent[edge_node], tree_seeds=torch.tensor(list(tree_seeds), dtype=torch.long),
                   split_steps=list(split_steps), branch_factor=int(branch_factor), num_steps=int(num_steps),
                   sde_steps=list(sde_steps), mode=mode)


@dataclass(frozen=True, eq=False)
class TempFlowStructure(Structure):
    """Process rewards off ODE trajectories (TempFlow-GRPO, :class:`flowrl.rollout.TempFlowSampler`).

    Transition ``m`` is the branching SDE step of completion ``m`` (N = M); samples are in
    (prompt, seed, step, branch) order.
    """

    name: ClassVar[str] = "tempflow"
    made_by: ClassVar[str] = "TempFlowSampler"

    trajectory: torch.Tensor        # [M] long, main ODE trajectory (prompt p, seed slot s: p * S + s)
    seed_slot: torch.Tensor         # [M] long, s, the initial noise within its prompt
    step: torch.Tensor              # [M] long, branch step k of the transition
    branch: torch.Tensor            # [M] long, child b of that step
    group_by: str = "seed"          # default advantage grouping (flowrl.advantages.tempflow.GROUP_BY)
    branch_steps: Sequence[int] = ()  # the branch steps B, increasing
    step_weights: Optional[torch.Tensor] = None  # [T] float32, loss weight per step (0: not trained)
    main_rewards: Optional[torch.Tensor] = None  # [P * S] float32, reward of each main trajectory (NaN: not run)


S = TypeVar("S", bound=Structure)


def layout_of(rollout, kind: type[S]) -> S:
    """``rollout.layout`` checked to be a ``kind`` record, else a ValueError naming what is wrong."""
    layout = getattr(rollout, "layout", None)
    if not isinstance(layout, kind):
        got = type(layout).__name__ if layout is not None else "no layout"
        raise ValueError(f"rollout layout is {got}, not a {kind.__name__}: not a {kind.made_by} rollout (structure "
                         f"{kind.name!r} needs one); pair the advantage function with its sampler")
    return layout
