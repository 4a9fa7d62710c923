"""BranchGRPO parity: flowrl's peer-compatible tree options against the authors' public code.

The expected values come from plain-Python references written here from the formulas of
BranchGRPO's training script (arXiv 2509.06040; fastvideo/train_branchgrpo_flux.py of the
authors' repository): recursive child-edge softmax fusion, per-depth normalisation, a
depth-first walk collecting the edges, a sliding excluded depth window, width modes 1 and 2.
"""
import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages.tree import branch_structure, depth_window_mask, fuse_rewards, fuse_rewards_children
from flowrl.advantages.tree_pruning import exclude_window, peer_width_mask, preorder_key
from flowrl.rollout import BranchSampler
from flowrl.structures import TreeStructure
from flowrl.trainers.config import load_config
from flowrl.trainers.config_text import shipped_recipes

SPLITS = (0, 3, 6, 9)


# --- a tree numbered as BranchSampler numbers it, built in plain Python ----------------------
def build_tree(num_steps=20, splits=SPLITS, k=2, trees=1):
    """Roots 0..P-1, then each step's children in active-row order (tree-major, path order)."""
    parent, depth, tree = [-1] * trees, [0] * trees, list(range(trees))
    active = list(range(trees))
    for i in range(num_steps):
        new = []
        for node in active:
            for _ in range(k if i in splits else 1):
                parent.append(node)
                depth.append(i + 1)
                tree.append(tree[node])
                new.append(len(parent) - 1)
        active = new
    return parent, depth, tree, active  # active = leaf nodes, leaf l = row l


def fake_rollout(seed=0, trees=1, num_steps=20, splits=SPLITS, rewards=None):
    parent, depth, tree, leaves = build_tree(num_steps, splits, 2, trees)
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(len(parent), generator=g)  # [nodes] edge log-probs (nats per element)
    lp[:trees] = 0.0
    r = torch.rand(len(leaves), generator=g) if rewards is None else torch.tensor(rewards)
    p = torch.tensor(parent)
    m = len(parent) - trees  # every non-root node has a stored edge into it
    node_edge = torch.cat([torch.full((trees,), -1), torch.arange(m)])  # [nodes]
    layout = TreeStructure.from_tree(p, torch.tensor(depth), torch.tensor(tree), lp, node_edge, torch.tensor(leaves),
                                     m, tree_seeds=range(trees), split_steps=splits, branch_factor=2,
                                     num_steps=num_steps, sde_steps=range(num_steps))
    assert torch.equal(layout.edge_node, torch.arange(trees, len(parent)))
    step = torch.tensor(depth[trees:]) - 1  # [M]
    return SimpleNamespace(rewards=r, layout=layout, transitions=SimpleNamespace(step=step))


# --- the peer's formulas, transcribed as plain loops ----------------------------------------
def ref_node_values(parent, depth, lp, leaves, rewards, weighted, alpha=1.0):
    """Leaves: their reward. weighted: softmax over the immediate children's edge log-probs,
    one child passes through; else the plain mean of all leaf descendants."""
    kids = {n: [] for n in range(len(parent))}
    for n, p in enumerate(parent):
        if p >= 0:
            kids[p].append(n)
    val = {node: float(rewards[i]) for i, node in enumerate(leaves)}

    def leaf_values(n):
        return [val[n]] if not kids[n] else [v for c in kids[n] for v in leaf_values(c)]

    for d in reversed(range(max(depth))):
        for n in [m for m in range(len(parent)) if depth[m] == d and kids[m]]:
            if not weighted:
                vals = leaf_values(n)
                val[n] = sum(vals) / len(vals)
            elif len(kids[n]) == 1:
                val[n] = val[kids[n][0]]
            else:
                w = [math.exp(alpha * float(lp[c])) for c in kids[n]]
                val[n] = sum(wi * val[c] for wi, c in zip(w, kids[n])) / sum(w)
    return val, kids


def ref_depth_adv(val, depth, tree):
    """Per tree and depth: (v - mean) / (unbiased std + 1e-8); 0 for one node or std < 1e-6."""
    adv = {}
    for key in {(t, d) for t, d in zip(tree, depth)}:
        nodes = [n for n in range(len(depth)) if (tree[n], depth[n]) == key]
        vals = [val[n] for n in nodes]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        for n, v in zip(nodes, vals):
            adv[n] = 0.0 if len(vals) <= 1 or sd < 1e-6 else (v - statistics.mean(vals)) / (sd + 1e-8)
    return adv


def ref_trained(ro, *, weighted=False, iteration=0, window=None, start=15, stop=9, every=30, mode=None, ratio=0.5):
    """-> (edge advantage per child node, set of trained child nodes), the peer's way."""
    ex = ro.layout
    parent, depth, tree = ex.node_parent.tolist(), ex.node_depth.tolist(), ex.node_tree.tolist()
    val, kids = ref_node_values(parent, depth, ex.node_log_prob.tolist(), ex.leaf_node.tolist(),
                                ro.rewards.tolist(), weighted)
    adv = ref_depth_adv(val, depth, tree)
    samples = []

    def walk(n):  # every edge parent -> child, depth first, roots in batch order
        for c in kids[n]:
            samples.append({"child": c, "step": depth[c] - 1, "depth": depth[c], "adv": adv[c]})
            walk(c)

    for root in [n for n in range(len(parent)) if parent[n] < 0]:
        walk(root)
    if window is not None:  # the peer counts optimizer steps from 1
        shift = min((iteration + 1) // every, max(0, start - stop))
        pruned = {start - shift + j for j in range(window)}
        samples = [s for s in samples if s["depth"] not in pruned]
    if mode is not None:
        last = max(ex.split_steps)
        tail = [s for s in samples if s["step"] > last]
        rest = [s for s in samples if s["step"] <= last]
        if mode == 2:
            srt = sorted(tail, key=lambda s: s["adv"], reverse=True)
            k = max(2, int(len(srt) * ratio))
            best, worst = k // 2, k - k // 2
            tail = srt[:best] + (srt[-worst:] if worst else [])
        else:
            groups = {}
            for s in tail:
                a = parent[s["child"]]
                while depth[a] != last + 1:  # up to the child of the last split
                    a = parent[a]
                groups.setdefault(a, []).append(s)
            tail = []
            for grp in groups.values():
                tail += sorted(grp, key=lambda s: s["adv"], reverse=True)[:max(1, int(len(grp) * ratio))]
        samples = rest + tail
    return adv, {s["child"] for s in samples}


def trained_nodes(ro, info):
    return set(ro.layout.edge_node[info["train_mask"]].tolist())


# --- 1. depth pruning ------------------------------------------------------------------------
def test_builder_matches_branch_sampler_and_default_edge_counts(tiny_digits_policy):
    def brightness(images, prompts, **_):
        return images.mean(dim=(1, 2, 3))  # [B]

    ro = BranchSampler()(tiny_digits_policy, ["a handwritten digit 3"], brightness, seed=3)
    parent, depth, _, leaves = build_tree()
    assert ro.layout.node_parent.tolist() == parent and ro.layout.node_depth.tolist() == depth
    assert ro.layout.leaf_node.tolist() == leaves and len(ro.transitions) == 218
    # the peer removes depths 15-18 (steps 14-17, 4 x 16 edges) at first, 9-12 (8 + 3 x 16) at the end
    assert branch_structure(ro, compat="branchgrpo", depth_window=4, iteration=0)[1]["trained_edges"] == 154
    assert branch_structure(ro, compat="branchgrpo", depth_window=4, iteration=299)[1]["trained_edges"] == 162
    # flowrl's own window trains depths 1-4 only (2 + 2 + 2 + 4 edges)
    assert branch_structure(ro, depth_window=4, iteration=0)[1]["trained_edges"] == 10


@pytest.mark.parametrize("iteration, first, trained", [
    (0, 15, 154), (28, 15, 154), (29, 14, 154), (59, 13, 154), (89, 12, 154), (119, 11, 154),
    (149, 10, 154), (178, 10, 154), (179, 9, 162), (240, 9, 162), (299, 9, 162), (10_000, 9, 162)])
def test_exclude_window_schedule_on_default_tree(iteration, first, trained):
    ro = fake_rollout()
    _, info = branch_structure(ro, depth_mode="exclude_window", depth_window=4, iteration=iteration)
    assert info["depth_window_start"] == first and info["trained_edges"] == trained
    d = ro.layout.node_depth[ro.layout.edge_node]  # [M]
    assert set(d[~info["train_mask"]].tolist()) == set(range(first, first + 4))
    _, ref = ref_trained(ro, iteration=iteration, window=4)
    assert trained_nodes(ro, info) == ref


def test_exclude_window_options():
    assert exclude_window(20, 4, None, 9, 0) == 15  # default start: the script's "15,16,17,18"
    assert exclude_window(20, 4, 12, 9, 89) == 9 and exclude_window(20, 4, 12, 9, 10_000) == 9  # stops, no wrap
    assert exclude_window(20, 4, 15, 9, 10_000, slide_every=None) == 15  # fixed window
    assert exclude_window(20, 4, 15, 16, 10_000) == 15  # stop deeper than start: never slides
    assert exclude_window(20, 2, 18, 1, 59, slide_every=10) == 12  # step 60 // 10 = 6
    # flowrl's train_window is unchanged: it wraps around
    assert depth_window_mask(torch.arange(1, 21), 20, 4, 17 * 30)[1] == 1


# --- 2. fusion --------------------------------------------------------------------------------
#   0 (root) -> 1 -> 2, 3;  2 -> 4, 5;  3 -> 6, 7 (leaves), rewards 1, 3, 0, 4
PARENT = torch.tensor([-1, 0, 1, 1, 2, 2, 3, 3])
DEPTH = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3])
LEAVES = torch.tensor([4, 5, 6, 7])
R = torch.tensor([1.0, 3.0, 0.0, 4.0])
LP = torch.tensor([0.0, -5.0, math.log(2), 0.0, 0.0, math.log(3), 0.0, 0.0])


def test_children_softmax_fusion_by_hand():
    v = fuse_rewards_children(R, PARENT, DEPTH, LEAVES, LP)
    # node 2: w (1, 3)/4 -> 2.5; node 3: (1, 1)/2 -> 2; node 1: w (2, 1)/3 over (2.5, 2) -> 7/3;
    # node 0 has one child: passes 7/3 through (its edge log-prob -5 plays no part)
    assert torch.allclose(v, torch.tensor([7 / 3, 7 / 3, 2.5, 2.0, 1.0, 3.0, 0.0, 4.0]), atol=1e-6)
    assert torch.allclose(fuse_rewards(R, PARENT, LEAVES, LP, 1.0)[:2], torch.tensor([2.4, 2.4]))  # differs
    half = fuse_rewards_children(R, PARENT, DEPTH, LEAVES, LP, beta_f=0.5)
    assert math.isclose(half[2].item(), (1 + 3 * math.sqrt(3)) / (1 + math.sqrt(3)), rel_tol=1e-6)
    nan = fuse_rewards_children(torch.tensor([1.0, float("nan"), float("nan"), float("nan")]), PARENT, DEPTH,
                                LEAVES, LP)
    assert nan[2] == 1.0 and nan[3].isnan() and nan[1] == 1.0  # non-finite children are left out


@pytest.mark.parametrize("seed", [0, 1])
def test_children_softmax_fusion_matches_reference_on_default_tree(seed):
    ro = fake_rollout(seed, trees=2)
    ex = ro.layout
    v = fuse_rewards_children(ro.rewards, ex.node_parent, ex.node_depth, ex.leaf_node, ex.node_log_prob)
    ref, _ = ref_node_values(ex.node_parent.tolist(), ex.node_depth.tolist(), ex.node_log_prob.tolist(),
                             ex.leaf_node.tolist(), ro.rewards.tolist(), weighted=True)
    assert torch.allclose(v, torch.tensor([ref[n] for n in range(len(v))]), atol=1e-5)
    path = fuse_rewards(ro.rewards, ex.node_parent, ex.leaf_node, ex.node_log_prob, 1.0)
    assert (path - v).abs().max() > 1e-3  # flowrl's one-softmax-over-leaves is a different estimator
    adv, _ = branch_structure(ro, compat="branchgrpo", fusion="softmax_children")
    ref_adv, _ = ref_trained(ro, weighted=True)
    assert torch.allclose(adv, torch.tensor([ref_adv[n] for n in ex.edge_node.tolist()]), atol=1e-4)


# --- 3. width pruning -------------------------------------------------------------------------
def test_pooled_extremes_by_hand_truncation_split_and_ties():
    adv = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, -1.0, -1.0, 9.0])
    step = torch.tensor([5] * 7 + [1])  # the last edge precedes the last split (3): always kept
    order = torch.tensor([6, 5, 4, 3, 2, 1, 0, 7])  # walk order, reversed against edge order
    zero = torch.zeros(8, dtype=torch.long)
    # n = 7: k = int(3.5) = 3 -> best 1, worst 2; sorted (ties in walk order): 1, 0, 4, 3, 2, 6, 5
    keep = peer_width_mask(adv, step, zero, order, 3, 0.5, "pooled_extremes")
    assert torch.nonzero(keep).flatten().tolist() == [1, 5, 6, 7]
    # depth-pruned edges are not candidates: n = 6 -> k = 3; sorted 1, 0, 4, 2, 6, 5 (3 is out)
    eligible = torch.tensor([True, True, True, False, True, True, True, True])
    keep = peer_width_mask(adv, step, zero, order, 3, 0.5, "pooled_extremes", eligible)
    assert torch.nonzero(keep & eligible).flatten().tolist() == [1, 5, 6, 7]
    # n = 3: k = max(2, int(1.5)) = 2 -> best 1, worst 1; n = 1: the one edge is kept
    three = peer_width_mask(torch.tensor([0.3, 0.1, 0.2]), torch.full((3,), 5), zero[:3], torch.arange(3), 3, 0.5,
                            "pooled_extremes")
    assert three.tolist() == [True, True, False]
    assert peer_width_mask(torch.tensor([0.3]), torch.tensor([5]), zero[:1], zero[:1], 3, 0.5, "pooled_extremes").all()


def test_chain_top_by_hand():
    adv = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2, -1.0, 2.0, 0.5, 0.0, 0.1])
    step = torch.tensor([4, 5, 6, 7, 8, 4, 5, 6, 7, 8])
    chain = torch.tensor([0] * 5 + [1] * 5)
    # n = 5 per chain: k = int(2.5) = 2; chain 0 ties -> the first two in walk order
    keep = peer_width_mask(adv, step, chain, torch.arange(10), 3, 0.5, "chain_top")
    assert torch.nonzero(keep).flatten().tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("mode, name", [(2, "pooled_extremes"), (1, "chain_top")])
@pytest.mark.parametrize("window, iteration", [(None, 0), (4, 0), (4, 200)])
def test_width_modes_match_reference_on_default_trees(mode, name, window, iteration):
    ro = fake_rollout(seed=3, trees=2)
    _, info = branch_structure(ro, compat="branchgrpo", width_keep_ratio=0.5, width_mode=name,
                               depth_window=window, iteration=iteration)
    _, ref = ref_trained(ro, window=window, iteration=iteration, mode=mode)
    assert trained_nodes(ro, info) == ref
    if window is None:  # half of the 2 x 160 post-split edges go
        assert info["trained_edges"] == 436 - 160


def test_width_modes_on_default_tree_counts_and_tie_rule():
    ro = fake_rollout(seed=5)
    step = ro.transitions.step
    _, pooled = branch_structure(ro, compat="branchgrpo", width_keep_ratio=0.5)
    assert pooled["trained_edges"] == 138 and pooled["train_mask"][step <= 9].all()
    _, chain = branch_structure(ro, compat="branchgrpo", width_keep_ratio=0.5, width_mode="chain_top")
    # a chain's edges tie (every node holds its leaf's value): the 5 shallowest of each are kept
    assert chain["trained_edges"] == 138 and chain["train_mask"][(step >= 10) & (step <= 14)].all()
    assert not chain["train_mask"][step >= 15].any()
    # with the excluded window 15-18 (steps 14-17) the tails have 6 edges per chain: keep 3
    _, both = branch_structure(ro, compat="branchgrpo", width_keep_ratio=0.5, width_mode="chain_top",
                               depth_window=4)
    assert both["trained_edges"] == 154 - 16 * 3
    # flowrl's per-(tree, step) modes stay as they were
    _, own = branch_structure(ro, width_keep_ratio=0.5, width_mode="parent_top1")
    assert own["trained_edges"] == 138 and own["train_mask"][step == 19].sum() == 8


def test_preorder_key_is_depth_first_walk():
    key = preorder_key(PARENT, DEPTH, LEAVES)
    assert torch.argsort(key).tolist() == [0, 1, 2, 4, 5, 3, 6, 7]


# --- preset and errors ------------------------------------------------------------------------
def test_compat_defaults_equal_explicit_peer_options():
    ro = fake_rollout(seed=7, trees=2)
    a = branch_structure(ro, compat="branchgrpo", width_keep_ratio=0.5, depth_window=4, iteration=100)
    b = branch_structure(ro, fusion="mean", width_keep_ratio=0.5, width_mode="pooled_extremes", depth_window=4,
                         depth_mode="exclude_window", depth_start=15, depth_stop=9, iteration=100)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["train_mask"], b[1]["train_mask"])
    _, ref = ref_trained(ro, window=4, iteration=100, mode=2)
    assert trained_nodes(ro, a[1]) == ref and a[1]["depth_window_start"] == 12


@pytest.mark.parametrize("kwargs, match", [
    (dict(compat="branchgrpo", fusion="softmax"), "fusion 'softmax' with compat='branchgrpo'.*softmax_children"),
    (dict(compat="branchgrpo", width_keep_ratio=0.5, width_mode="extremes"), "pooled_extremes"),
    (dict(compat="branchgrpo", depth_mode="train_window"), "exclude_window"),
    (dict(compat="dance"), "choose one of \\['branchgrpo'\\]"),
    (dict(depth_mode="slide"), "train_window"),
    (dict(depth_window=4, depth_start=15), "exclude_window"),
    (dict(depth_mode="exclude_window", depth_window=4, depth_start=18), "depth_start"),
    (dict(depth_mode="exclude_window", depth_window=4, depth_stop=0), "depth_stop"),
    (dict(depth_mode="exclude_window", depth_window=4, depth_slide_every=0), "depth_slide_every"),
    (dict(fusion="softmax_children", width_keep_ratio=1.5, width_mode="chain_top"), "width_keep_ratio"),
])
def test_bad_peer_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        branch_structure(fake_rollout(), **kwargs)


def test_branch_recipes_options_are_valid_and_peer_compatible():
    recipes = [r for r in shipped_recipes() if "branch" in r.name]
    assert {r.name for r in recipes} >= {"sd3_branch_hps.yaml", "flux_branch_hps.yaml", "digits_branch.yaml"}
    ro = fake_rollout()
    for r in recipes:
        opts = load_config(r).train.loss_options.get("advantage_options", {})
        _, info = branch_structure(ro, iteration=0, **opts)
        assert info["train_mask"].dtype == torch.bool
        if r.name != "digits_branch.yaml":  # the HPS recipes reproduce the peer's script
            assert opts.get("compat") == "branchgrpo"
