"""Tree pruning as BranchGRPO's public code does it (arXiv 2509.06040). Pure functions.

flowrl's own pruning (:func:`flowrl.advantages.tree.width_prune_mask`,
:func:`flowrl.advantages.tree.depth_window_mask`) keeps its semantics; this module holds the
variants that reproduce the authors' training script (``fastvideo/train_branchgrpo_flux.py``
of the BranchGRPO repository), selected by ``depth_mode="exclude_window"`` and
``width_mode="pooled_extremes" | "chain_top"`` of :func:`flowrl.advantages.tree.branch_structure`.

Depths: the root is depth 0 and the child made by step ``i`` has depth ``i + 1`` (in the
peer's code and in :class:`flowrl.rollout.branch.BranchSampler`); an edge's depth is its child's.
"""
from __future__ import annotations

from typing import Optional

import torch

PEER_WIDTH_MODES = ("pooled_extremes", "chain_top")


def first_leaf(parent: torch.Tensor, leaf_node: torch.Tensor) -> torch.Tensor:
    """Smallest leaf index below each node -> ``[nodes]`` long (``L`` for a node above no leaf)."""
    lo = torch.full((parent.numel(),), leaf_node.numel(), dtype=torch.long)
    cur, lid = leaf_node.long(), torch.arange(leaf_node.numel())
    while cur.numel():  # walk every leaf up to its root
        lo.scatter_reduce_(0, cur, lid, reduce="amin")
        up = parent[cur]
        keep = up >= 0
        cur, lid = up[keep], lid[keep]
    return lo


def preorder_key(parent: torch.Tensor, depth: torch.Tensor, leaf_node: torch.Tensor) -> torch.Tensor:
    """Depth-first pre-order position key of every node -> ``[nodes]`` long (smaller = earlier).

    The order in which the peer's code collects its training transitions (a recursive walk
    over each root's children, roots in batch order): a node precedes its subtree, and a
    subtree precedes its next sibling's. Siblings are ordered by their first leaf, i.e. leaves
    must be numbered in walk order (true for BranchSampler: subtree leaves are contiguous).
    Key = ``first_leaf * (max_depth + 1) + depth``.
    """
    lo = first_leaf(parent, leaf_node)  # [nodes]
    span = int(depth.max()) + 1 if depth.numel() else 1
    return lo * span + depth.long()


def exclude_window(num_depths: int, window: int, start: Optional[int], stop: int, iteration: int = 0,
                   slide_every: Optional[int] = 30) -> int:
    """First (shallowest) depth of the peer's excluded depth window at flowrl ``iteration``.

    BranchGRPO code (``--depth_pruning`` "15,16,17,18", ``--depth_pruning_slide``,
    ``--depth_pruning_slide_interval`` 30, ``--depth_pruning_stop_depth`` 9): the window of
    ``window`` depths starts at ``start`` and moves one depth shallower every ``slide_every``
    optimizer steps, ``shift = min(step // slide_every, start - stop)``; it stops (never wraps)
    once its shallowest depth reaches ``stop``. The peer counts steps from 1 (its loop runs
    ``range(init_steps + 1, max_train_steps + 1)``), flowrl iterations from 0: ``step =
    iteration + 1``. ``slide_every=None``: a fixed window. ``start=None``: ``num_depths -
    window - 1`` (15 for T = 20 and 4 depths: the script's example "15,16,17,18").
    """
    if not isinstance(window, int) or not 1 <= window <= num_depths:
        raise ValueError(f"depth_window must be an integer in [1, {num_depths}], got {window!r}")
    if start is None:
        start = max(1, num_depths - window - 1)
    if not isinstance(start, int) or not 1 <= start <= num_depths - window + 1:
        raise ValueError(f"depth_start must be an integer in [1, {num_depths - window + 1}] "
                         f"(the window's shallowest depth at iteration 0), got {start!r}")
    if not isinstance(stop, int) or stop < 1:
        raise ValueError(f"depth_stop must be a positive integer depth, got {stop!r}")
    if slide_every is None:
        return start
    if not isinstance(slide_every, int) or slide_every < 1:
        raise ValueError(f"depth_slide_every must be a positive integer or None, got {slide_every!r}")
    shift = min((int(iteration) + 1) // slide_every, max(0, start - stop))
    return start - shift


def peer_width_mask(adv: torch.Tensor, step: torch.Tensor, group: torch.Tensor, order: torch.Tensor,
                    last_split: int, keep_ratio: float, mode: str,
                    eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """BranchGRPO code's width pruning (``--width_pruning_mode`` 1 / 2) -> keep mask ``[M]`` bool.

    Candidates: the ``eligible`` edges (those depth pruning left, all if None) with ``step >
    last_split``; every other edge is kept. Candidates are ranked by advantage, best first,
    ties in ``order`` (the peer's walk order, :func:`preorder_key`; Python's stable sort).

    * ``"pooled_extremes"`` (mode 2): one pool of all candidates of the rollout (in the peer
      all trees of the rank's batch; ``group`` is ignored). ``k = max(2, int(n * keep_ratio))``
      (truncated), the ``k // 2`` best and the ``k - k // 2`` worst are kept. With n = 1 the
      peer trains its one edge twice; here it is kept once.
    * ``"chain_top"`` (mode 1): per ``group`` (the child of the last split above the edge:
      one leaf chain for the default tree), ``k = max(1, int(n * keep_ratio))`` best are kept.
      Along a chain every node has its leaf's value, so the advantages tie and the ``k``
      shallowest edges are kept (steps 10-14 of 10-19 for the default tree, ratio 0.5).

    Args:
        adv: ``[M]`` edge advantages before clipping (the peer sorts unclipped ones).
        step: ``[M]`` long, group: ``[M]`` long, order: ``[M]`` long walk-order key.
    """
    if mode not in PEER_WIDTH_MODES:
        raise ValueError(f"unknown peer width mode {mode!r}; choose one of {PEER_WIDTH_MODES}")
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"width_keep_ratio must be in (0, 1], got {keep_ratio}")
    keep = torch.ones(adv.shape[0], dtype=torch.bool)
    cand = step > last_split
    if eligible is not None:
        cand &= eligible
    region = torch.nonzero(cand).flatten()  # [R]
    if region.numel() == 0:
        return keep
    g = torch.zeros_like(region) if mode == "pooled_extremes" else group[region].long()  # [R]
    _, gid = torch.unique(g, return_inverse=True)  # [R]
    idx = torch.argsort(order[region], stable=True)  # walk order
    idx = idx[torch.argsort(-adv[region][idx].float(), stable=True)]  # best first, ties in walk order
    idx = idx[torch.argsort(gid[idx], stable=True)]  # grouped
    gs = gid[idx]  # [R]
    cnt = torch.bincount(gid)  # [G]
    rank = torch.arange(region.numel()) - (torch.cumsum(cnt, 0) - cnt)[gs]  # [R] 0 = best of its group
    n = cnt[gs]  # [R]
    k = torch.floor(n.double() * keep_ratio).long()  # [R] Python int(n * ratio) (float64, truncation)
    if mode == "pooled_extremes":
        k = k.clamp(min=2)
        best = k // 2
    else:
        k = k.clamp(min=1)
        best = k
    kept = (rank < best) | (rank >= n - (k - best))  # [R]
    keep[region[idx]] = kept
    return keep
