"""Tree advantages (BranchGRPO, Li et al. 2025, arXiv 2509.06040; docs/algorithms.md §4). Pure functions.

A tree is given by per-node tensors: ``parent`` [nodes] (-1 for a root), ``depth`` [nodes],
``tree`` [nodes] (which prompt tree), ``edge_log_prob`` [nodes] (log-prob of the edge into
the node, 0 for roots and deterministic edges) and ``leaf_node`` [L] (node of each leaf, leaf
``l`` owns reward ``r_l``). :class:`flowrl.rollout.branch.BranchSampler` stores these in
``Rollout.layout``, a :class:`flowrl.structures.TreeStructure`; :func:`branch_structure` is the entry point of
``flowrl.advantages.ADVANTAGES["branch"]``.

Log-probs are the step functions' per-element means (``flowrl.sde``), so path sums are in
nats per element, summed over edges.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..structures import TreeStructure, layout_of
from .aggregate import Normalised, aggregate
from .group import ADV_CLIP
from .tree_pruning import PEER_WIDTH_MODES, exclude_window, peer_width_mask, preorder_key

DEPTH_EPS = 1e-8      # A_d(n) = (rbar - mean_d) / (std_d + 1e-8)  (BranchGRPO public code)
DEPTH_MIN_STD = 1e-6  # a depth whose std is below this carries no signal: A = 0
FUSIONS = ("mean", "softmax", "softmax_children")
WIDTH_MODES = ("extremes", "parent_top1")
DEPTH_MODES = ("train_window", "exclude_window")
# compat="branchgrpo": the option values that reproduce BranchGRPO's public training script
COMPAT = {"branchgrpo": {"fusions": ("mean", "softmax_children"), "width_modes": PEER_WIDTH_MODES,
                         "depth_modes": ("exclude_window",), "width_mode": "pooled_extremes",
                         "depth_mode": "exclude_window"}}


def ancestor_pairs(parent: torch.Tensor, leaf_node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (node, leaf) pair with the node on the leaf's root path (the leaf itself included).

    Returns ``(node [Q] long, leaf [Q] long)``, ``Q = sum over leaves of (depth + 1)``: the
    leaf membership of every node, as a sparse list (memory O(L x depth), not O(nodes x L)).
    """
    nodes, leaves = [], []
    cur, lid = leaf_node.long(), torch.arange(leaf_node.numel())
    while cur.numel():
        nodes.append(cur)
        leaves.append(lid)
        up = parent[cur]
        keep = up >= 0
        cur, lid = up[keep], lid[keep]
    if not nodes:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(nodes), torch.cat(leaves)


def path_log_prob(parent: torch.Tensor, edge_log_prob: torch.Tensor) -> torch.Tensor:
    """Summed edge log-probs from the root down to each node -> ``[nodes]`` float32."""
    lp = edge_log_prob.float()
    cum = lp.clone()
    cur = parent.long().clone()
    while (cur >= 0).any():
        m = cur >= 0
        cum[m] += lp[cur[m]]
        cur[m] = parent[cur[m]]
    return cum


def fuse_rewards(leaf_rewards: torch.Tensor, parent: torch.Tensor, leaf_node: torch.Tensor,
                 edge_log_prob: Optional[torch.Tensor] = None, beta_f: float = 0.0) -> torch.Tensor:
    """Node rewards ``rbar(n) = sum_{l in leaves(n)} w_l r_l`` (BranchGRPO, arXiv 2509.06040).

    ``w = softmax_l(beta_f * s_l)`` over the leaves below ``n``, ``s_l`` = summed edge
    log-probs on the path from ``n`` down to ``l``. ``beta_f = 0``: the plain mean of the
    leaf rewards; ``beta_f = 1``: path-probability weighting. ``s_l = P(l) - P(n)`` with ``P``
    the root-to-node sum (:func:`path_log_prob`), and the softmax is shift-invariant, so one
    root-to-leaf sum per leaf serves every ancestor.

    Args:
        leaf_rewards: ``[L]`` float32; non-finite rewards are left out of every average.
        parent, leaf_node, edge_log_prob: the tree (module docstring); ``edge_log_prob`` may
            be None when ``beta_f == 0``.
    Returns:
        ``[nodes]`` float32; NaN for a node without a finite leaf reward below it.
    """
    n = parent.numel()
    r = leaf_rewards.float()
    node, leaf = ancestor_pairs(parent, leaf_node)  # [Q], [Q]
    ok = torch.isfinite(r[leaf])
    node, leaf = node[ok], leaf[ok]
    if beta_f != 0.0:
        if edge_log_prob is None:
            raise ValueError("softmax reward fusion (beta_f != 0) needs the edge log-probs")
        cum = path_log_prob(parent, edge_log_prob)  # [nodes]
        logit = beta_f * (cum[leaf_node[leaf]] - cum[node])  # [Q] beta_f * s_l, relative to n
        top = torch.full((n,), -torch.inf).scatter_reduce(0, node, logit, reduce="amax", include_self=True)
        w = torch.exp(logit - top[node])  # [Q], max weight 1 per node
    else:
        w = torch.ones(node.numel())  # [Q]
    num = torch.zeros(n).index_add_(0, node, w * r[leaf])  # [nodes] sum_l w_l r_l
    den = torch.zeros(n).index_add_(0, node, w)  # [nodes] sum_l w_l
    return torch.where(den > 0, num / den.clamp(min=1e-30), torch.full_like(num, float("nan")))


def fuse_rewards_children(leaf_rewards: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                          leaf_node: torch.Tensor, edge_log_prob: torch.Tensor, beta_f: float = 1.0) -> torch.Tensor:
    """Recursive child-softmax node rewards (BranchGRPO public code, ``--tree_prob_weighted``).

    Bottom-up (arXiv 2509.06040, path-weighted fusion as the authors' script computes it):
    ``rbar(n) = sum_{c in children(n)} softmax_c(beta_f * lp_c) rbar(c)``, ``lp_c`` the
    log-prob of the edge into child ``c`` (nats per element, one edge, not a path sum); a leaf
    keeps its reward and a single child passes its value through (weight 1). The peer fixes
    ``beta_f`` (its ``alpha``) at 1.0. Unlike :func:`fuse_rewards` (one softmax over the
    leaves of summed path log-probs), each level renormalises over the immediate children.

    Args:
        leaf_rewards: ``[L]`` float32; a child whose value is not finite is left out of its
            parent's softmax (the peer has no such case).
        parent, depth, leaf_node, edge_log_prob: the tree (module docstring).
    Returns:
        ``[nodes]`` float32; NaN for a node without a finite leaf reward below it.
    """
    n = parent.numel()
    val = torch.full((n,), float("nan"))
    val[leaf_node.long()] = leaf_rewards.float()
    logit_all = beta_f * edge_log_prob.float()  # [nodes]
    top_depth = int(depth.max()) if n else 0
    for d in range(top_depth, 0, -1):  # children at depth d fuse into their parents at d - 1
        kid = torch.nonzero((depth == d) & (parent >= 0) & torch.isfinite(val)).flatten()  # [C]
        if kid.numel() == 0:
            continue
        par = parent[kid].long()  # [C]
        logit = logit_all[kid]  # [C]
        top = torch.full((n,), -torch.inf).scatter_reduce(0, par, logit, reduce="amax", include_self=True)
        w = torch.exp(torch.where(logit == top[par], 0.0, logit - top[par]))  # [C] softmax numerators, max 1
        num = torch.zeros(n).index_add_(0, par, w * val[kid])  # [nodes]
        den = torch.zeros(n).index_add_(0, par, w)  # [nodes]
        has = den > 0
        val[has] = num[has] / den[has]
    return val


def depthwise_normalised(values: torch.Tensor, depth: torch.Tensor, tree: Optional[torch.Tensor] = None, *,
                         eps: float = DEPTH_EPS, min_std: float = DEPTH_MIN_STD) -> Normalised:
    """:func:`depthwise_advantages` as ``centred / scale`` (``centred = rbar(n) - mean_d``, ``scale = std_d +
    eps``; centred 0, scale 1 and ``zero`` where degenerate)."""
    v = values.float()
    tree = torch.zeros_like(depth) if tree is None else tree
    key = tree.long() * (int(depth.max()) + 1 if depth.numel() else 1) + depth.long()
    _, gid = torch.unique(key, return_inverse=True)  # [nodes] group of (tree, depth)
    g = int(gid.max()) + 1 if gid.numel() else 0
    ok = torch.isfinite(v)
    vz = torch.where(ok, v, torch.zeros_like(v))
    cnt = torch.zeros(g).index_add_(0, gid, ok.float())  # [G]
    mean = torch.zeros(g).index_add_(0, gid, vz) / cnt.clamp(min=1)  # [G]
    dev = torch.where(ok, v - mean[gid], torch.zeros_like(v))  # [nodes]
    var = torch.zeros(g).index_add_(0, gid, dev * dev) / (cnt - 1).clamp(min=1)  # [G] unbiased
    std = var.sqrt()  # [G]
    good = (cnt >= 2) & (std >= min_std)  # [G]
    degenerate = ~good[gid] | ~ok  # [nodes]
    return Normalised(torch.where(degenerate, torch.zeros_like(v), dev),
                      torch.where(degenerate, torch.ones_like(v), std[gid] + eps), degenerate)


def depthwise_advantages(values: torch.Tensor, depth: torch.Tensor, tree: Optional[torch.Tensor] = None, *,
                         eps: float = DEPTH_EPS, min_std: float = DEPTH_MIN_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_d(n) = (rbar(n) - mean_d) / (std_d + eps)`` over the nodes of depth d of one tree.

    (BranchGRPO, arXiv 2509.06040, depth-wise normalisation.) ``std_d`` is the unbiased std.
    A depth with fewer than two finite values, or ``std_d < min_std``, gives A = 0 and is
    marked degenerate (no signal); so does a node whose value is not finite.

    Args:
        values: ``[nodes]`` float32 node rewards (:func:`fuse_rewards`).
        depth: ``[nodes]`` long; tree: ``[nodes]`` long tree id (None: one tree).
    Returns:
        ``(A [nodes] float32, degenerate [nodes] bool)``; A is not clipped here.
    """
    n = depthwise_normalised(values, depth, tree, eps=eps, min_std=min_std)
    return n.advantages(None), n.zero


def edge_advantages(node_adv: torch.Tensor, edge_node: torch.Tensor, clip: float = ADV_CLIP) -> torch.Tensor:
    """Each edge takes its child node's advantage, clipped to ``+-clip`` -> ``[M]`` float32."""
    return node_adv.float()[edge_node].clamp(-clip, clip)


def ancestor_at_depth(parent: torch.Tensor, depth: torch.Tensor, nodes: torch.Tensor, d: int) -> torch.Tensor:
    """The ancestor at depth ``d`` of each of ``nodes`` [M] (itself if at depth d; -1 if shallower)."""
    cur = nodes.long().clone()
    while True:
        up = (cur >= 0) & (depth[cur.clamp(min=0)] > d)
        if not up.any():
            break
        cur[up] = parent[cur[up]]
    return torch.where((cur >= 0) & (depth[cur.clamp(min=0)] == d), cur, torch.full_like(cur, -1))


def width_prune_mask(adv: torch.Tensor, step: torch.Tensor, group: torch.Tensor, last_split: int,
                     keep_ratio: float, mode: str = "extremes") -> torch.Tensor:
    """Width pruning (BranchGRPO, arXiv 2509.06040): which edges keep their gradient -> ``[M]`` bool.

    Only edges whose step is after the last split (``step > last_split``) are pruned; the
    rest are all kept. Among the region's edges of one ``(group, step)``, ``n`` of them,
    ``k = max(1, round(n * keep_ratio))`` are kept:

    * ``"extremes"`` (``group`` = tree): the ``ceil(k / 2)`` highest and ``floor(k / 2)``
      lowest advantages (keep ratio 0.5: top and bottom quarter);
    * ``"parent_top1"`` (``group`` = the node that branched at the last split): the ``k``
      best children of each parent, i.e. the better child for K = 2 and ratio 0.5.

    Ties are broken by edge order (deterministic). The default tree (T = 20, splits
    (0, 3, 6, 9), K = 2) keeps ``218 - 80 = 138`` of its edges at ratio 0.5.
    """
    if mode not in WIDTH_MODES:
        raise ValueError(f"unknown width_mode {mode!r}; choose one of {WIDTH_MODES}")
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"width_keep_ratio must be in (0, 1], got {keep_ratio}")
    keep = torch.ones(adv.shape[0], dtype=torch.bool)
    region = torch.nonzero(step > last_split).flatten()  # [R]
    if region.numel() == 0:
        return keep
    key = group[region].long() * (int(step.max()) + 1) + step[region].long()
    _, gid = torch.unique(key, return_inverse=True)  # [R]
    order = torch.argsort(-adv[region].float(), stable=True)  # best first
    order = order[torch.argsort(gid[order], stable=True)]  # grouped, best first within a group
    gs = gid[order]  # [R]
    cnt = torch.bincount(gid)  # [G]
    start = torch.cumsum(cnt, 0) - cnt  # [G]
    rank = torch.arange(region.numel()) - start[gs]  # [R] 0 = best of its group
    n = cnt[gs]
    k = torch.clamp(torch.round(n.float() * keep_ratio).long(), min=1)
    top = (k + 1) // 2 if mode == "extremes" else k
    kept = (rank < top) | (rank >= n - (k - top))
    keep[region[order]] = kept
    return keep


def depth_window_mask(edge_depth: torch.Tensor, num_depths: int, window: int, iteration: int = 0,
                      slide_every: int = 30) -> tuple[torch.Tensor, int]:
    """Depth pruning: train only edges whose child depth lies in a window of ``window`` depths.

    Depths run ``1..num_depths`` (an edge of step i has child depth i + 1). The window starts
    at depth 1 and slides by one every ``slide_every`` iterations, wrapping around after the
    deepest position (docs/algorithms.md §4: 4 depths, one slide per 30 iterations).
    Returns ``(mask [M] bool, first depth of the window)``.
    """
    if not isinstance(window, int) or not 1 <= window <= num_depths:
        raise ValueError(f"depth_window must be an integer in [1, {num_depths}], got {window!r}")
    if not isinstance(slide_every, int) or slide_every < 1:
        raise ValueError(f"depth_slide_every must be a positive integer, got {slide_every!r}")
    start = 1 + (int(iteration) // slide_every) % (num_depths - window + 1)
    return (edge_depth >= start) & (edge_depth < start + window), start


def resolve_modes(compat: Optional[str], fusion: Optional[str], width_mode: Optional[str],
                  depth_mode: Optional[str]) -> tuple[str, str, str]:
    """Defaults and checks of the mode options -> ``(fusion, width_mode, depth_mode)``.

    ``compat=None``: flowrl's modes by default (``"mean"``, ``"extremes"``, ``"train_window"``),
    any valid value allowed. ``compat="branchgrpo"``: BranchGRPO's public code (arXiv
    2509.06040) by default (``"mean"``, ``"pooled_extremes"``, ``"exclude_window"``), and only
    the values that the peer's script can express (``fusion`` ``"mean"`` or
    ``"softmax_children"``; ``width_mode`` ``"pooled_extremes"`` or ``"chain_top"``).
    """
    if compat is not None and compat not in COMPAT:
        raise ValueError(f"unknown compat {compat!r}; choose one of {sorted(COMPAT)} or None (flowrl's own choices)")
    c = COMPAT.get(compat, {"fusions": FUSIONS, "width_modes": WIDTH_MODES + PEER_WIDTH_MODES,
                            "depth_modes": DEPTH_MODES, "width_mode": "extremes", "depth_mode": "train_window"})
    fusion = "mean" if fusion is None else fusion
    width_mode = c["width_mode"] if width_mode is None else width_mode
    depth_mode = c["depth_mode"] if depth_mode is None else depth_mode
    for name, value, allowed in (("fusion", fusion, c["fusions"]), ("width_mode", width_mode, c["width_modes"]),
                                 ("depth_mode", depth_mode, c["depth_modes"])):
        if value not in allowed:
            extra = f" with compat={compat!r}" if compat is not None else ""
            raise ValueError(f"unknown {name} {value!r}{extra}; choose one of {tuple(allowed)}")
    return fusion, width_mode, depth_mode


def branch_structure(rollout, *, iteration: int = 0, fusion: Optional[str] = None, beta_f: Optional[float] = None,
                     width_keep_ratio: Optional[float] = None, width_mode: Optional[str] = None,
                     depth_window: Optional[int] = None, depth_slide_every: Optional[int] = 30,
                     depth_mode: Optional[str] = None, depth_start: Optional[int] = None,
                     depth_stop: Optional[int] = None, compat: Optional[str] = None,
                     per_reward_weights: Optional[dict] = None, reward_weights: Optional[dict] = None,
                     adv_clip: float = ADV_CLIP, **_: object) -> tuple[torch.Tensor, dict]:
    """Advantages of a BranchSampler rollout: fuse, normalise per depth, map to edges, prune.

    Args:
        fusion: ``"mean"`` (default, ``beta_f = 0``), ``"softmax"`` (one softmax over the
            leaves of summed path log-probs, :func:`fuse_rewards`, ``beta_f`` default 1.0) or
            ``"softmax_children"`` (the peer code's recursive child-edge softmax,
            :func:`fuse_rewards_children`, ``beta_f`` default 1.0 as in the peer).
        width_keep_ratio: None = no width pruning. ``width_mode`` ``"extremes"`` /
            ``"parent_top1"``: :func:`width_prune_mask`, independent of depth pruning;
            ``"pooled_extremes"`` / ``"chain_top"``: the peer's modes 2 / 1
            (:func:`flowrl.advantages.tree_pruning.peer_width_mask`), applied to the edges
            that depth pruning left, as in the peer.
        depth_window: None = train all depths, else a window of this many depths;
            ``depth_mode="train_window"``: only the window trains (:func:`depth_window_mask`,
            slides every ``depth_slide_every`` iterations, wraps); ``"exclude_window"``: the
            window is removed from training as in the peer
            (:func:`flowrl.advantages.tree_pruning.exclude_window`: starts at ``depth_start``,
            default ``T - window - 1``, slides shallower, stops at ``depth_stop``, default the
            last split step).
        compat: None, or ``"branchgrpo"``: the peer code's modes by default and only those
            allowed (:func:`resolve_modes`). Pruning stays off unless its option is set.
        per_reward_weights: each reward fused and normalised per depth apart, clipped to ``+-adv_clip``, then
            weighted and summed (``reward.aggregate: per_reward``; :func:`flowrl.advantages.aggregate`); else the
            weighted sum ``rollout.rewards`` is fused, and ``reward_weights`` splits it into contributions.
        adv_clip: edge advantages are clipped to ``+-adv_clip`` (the trainer passes
            ``train.loss_options.adv_clip_max``).
    Returns:
        ``(A [M] float32, info)``; info: ``train_mask`` [M] bool (pruned edges False), ``contributions``
        (name -> ``[M]``, each reward's part of the edge advantages),
        ``zero_var`` [M] bool (degenerate depth: A = 0) and floats ``zero_var_fraction``,
        ``train_fraction``, ``trained_edges``, ``depth_window_start`` (first depth of the
        trained / excluded window; 0: no depth pruning).
    """
    fusion, width_mode, depth_mode = resolve_modes(compat, fusion, width_mode, depth_mode)
    beta = _fusion_beta(fusion, beta_f)
    if depth_mode == "train_window" and (depth_start is not None or depth_stop is not None):
        raise ValueError("depth_start / depth_stop apply to depth_mode='exclude_window' only; "
                         f"choose depth_mode from {DEPTH_MODES}")
    tree = layout_of(rollout, TreeStructure)
    parent, depth, edge_node = tree.node_parent, tree.node_depth, tree.edge_node  # [nodes], [nodes], [M]

    def normalise(leaf_rewards: torch.Tensor) -> Normalised:  # leaf rewards [L] -> fused, normalised per depth
        if fusion == "softmax_children":
            rbar = fuse_rewards_children(leaf_rewards, parent, depth, tree.leaf_node, tree.node_log_prob, beta)
        else:
            rbar = fuse_rewards(leaf_rewards, parent, tree.leaf_node, tree.node_log_prob, beta)  # [nodes]
        return depthwise_normalised(rbar, depth, tree.node_tree)

    # per_reward: each reward fused and normalised per depth, clipped, then weighted (the sum clipped at the edges)
    per_reward = bool(per_reward_weights)
    agg = aggregate(normalise, rollout.rewards, getattr(rollout, "reward_components", {}),
                    per_reward_weights or reward_weights, per_reward, adv_clip if per_reward else None)
    node_adv, degenerate = agg.advantages, agg.zero  # [nodes]
    adv = edge_advantages(node_adv, edge_node, adv_clip)  # [M]
    zero_var = degenerate[edge_node]  # [M]
    mask = torch.ones(adv.shape[0], dtype=torch.bool)
    start = 0
    if depth_window is not None:
        dmask, start = _depth_prune_mask(tree, depth_window, depth_mode, depth_start, depth_stop, iteration,
                                         depth_slide_every)
        mask &= dmask
    if width_keep_ratio is not None:
        mask &= _width_prune(tree, node_adv, adv, rollout.transitions.step, mask, float(width_keep_ratio), width_mode)
    m = max(adv.shape[0], 1)
    info = {"train_mask": mask, "zero_var": zero_var,
            "contributions": {k: v[edge_node] for k, v in agg.contributions.items()},
            "zero_var_fraction": zero_var.float().sum().item() / m, "train_fraction": mask.float().sum().item() / m,
            "trained_edges": float(mask.sum().item()), "depth_window_start": float(start)}
    return adv, info


def _fusion_beta(fusion: str, beta_f: Optional[float]) -> float:
    """``beta_f`` of a fusion: 0 for ``"mean"`` (which takes none), else ``beta_f`` (default 1.0)."""
    if fusion == "mean":
        if beta_f not in (None, 0, 0.0):
            raise ValueError(f"fusion='mean' ignores beta_f, got beta_f={beta_f}; use fusion='softmax' "
                             f"or 'softmax_children'")
        return 0.0
    return 1.0 if beta_f is None else float(beta_f)


def _depth_prune_mask(tree: TreeStructure, window: int, mode: str, depth_start: Optional[int],
                      depth_stop: Optional[int], iteration: int,
                      slide_every: Optional[int]) -> tuple[torch.Tensor, int]:
    """Depth pruning of the edges -> ``(mask [M] bool, first depth of the window)``.

    ``"train_window"``: only the window trains (:func:`depth_window_mask`); else the window is
    excluded (:func:`exclude_window`, ``depth_stop`` default the last split step).
    """
    edge_depth, num_depths = tree.node_depth[tree.edge_node], int(tree.num_steps)  # [M]
    if mode == "train_window":
        return depth_window_mask(edge_depth, num_depths, window, iteration, slide_every)
    stop = max(tree.split_steps) if depth_stop is None else depth_stop
    start = exclude_window(num_depths, window, depth_start, stop, iteration, slide_every)
    return (edge_depth < start) | (edge_depth >= start + window), start  # [M]


def _width_prune(tree: TreeStructure, node_adv: torch.Tensor, adv: torch.Tensor, step: torch.Tensor,
                 eligible: torch.Tensor, keep_ratio: float, mode: str) -> torch.Tensor:
    """Width pruning of the edges after the last split -> ``[M]`` bool (True: keeps its gradient).

    flowrl's modes (:func:`width_prune_mask`) ignore depth pruning; the peer's modes
    (:func:`peer_width_mask`) rank only the ``eligible`` [M] edges that depth pruning left.
    """
    parent, depth, edge_node = tree.node_parent, tree.node_depth, tree.edge_node  # [nodes], [nodes], [M]
    last = max(tree.split_steps)
    if mode in PEER_WIDTH_MODES:
        order = preorder_key(parent, depth, tree.leaf_node)[edge_node]  # [M] the peer's walk order
        group = ancestor_at_depth(parent, depth, edge_node, last + 1)  # [M] child of the last split
        return peer_width_mask(node_adv.float()[edge_node], step, group, order, last, keep_ratio, mode,
                               eligible=eligible)
    group = tree.node_tree[edge_node]  # [M]
    if mode == "parent_top1":
        group = ancestor_at_depth(parent, depth, edge_node, last)  # [M]
    return width_prune_mask(adv, step, group, last, keep_ratio, mode)
