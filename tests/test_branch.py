"""BranchGRPO tree rollouts and tree advantages (docs/algorithms.md §4, arXiv 2509.06040)."""
import math

import pytest
import torch

from flowrl.advantages import transition_advantages
from flowrl.advantages.tree import (ancestor_pairs, branch_structure, depth_window_mask, depthwise_advantages,
                                    edge_advantages, fuse_rewards, width_prune_mask)
from flowrl.rollout import BranchSampler, GroupSampler
from flowrl.rollout.branch import branch_noise
from flowrl.sde import dance_step, get_step
from flowrl.types import index_cond

P3, P7 = "a handwritten digit 3", "a handwritten digit 7"


def brightness(images, prompts, **_):
    return images.mean(dim=(1, 2, 3))  # [B]


SMALL = dict(num_steps=6, split_steps=(0, 2), branch_factor=2)  # n_i = 1,2,2,4,4,4,4: 17 evals, 20 edges


# --- the default tree: counts --------------------------------------------------------------
def test_default_tree_counts_evals_edges_and_width_pruning(tiny_digits_policy, counting):
    sampler = BranchSampler()
    assert sampler.evals_per_tree() == 203 and sampler.edges_per_tree() == 218 and sampler.num_leaves == 16
    pol = counting(tiny_digits_policy)
    ro = sampler(pol, [P3], brightness, seed=3)
    assert pol.rows == 203 and ro.stats["model_evals"] == 203 and pol.calls == 20
    assert len(ro.transitions) == 218 and ro.num_samples == 16 and ro.structure == "branch"
    assert ro.layout.node_parent.numel() == 219  # root + one node per edge
    assert ro.layout.split_steps == [0, 3, 6, 9]

    flat = counting(tiny_digits_policy)
    GroupSampler(group_size=16, num_steps=20, step="dance")(flat, [P3], brightness, seed=3)
    assert flat.rows == 320

    two = counting(tiny_digits_policy)  # two trees: one batched call per step
    ro2 = sampler(two, [P3, P7], brightness, seed=3)
    assert two.rows == 406 and two.calls == 20 and len(ro2.transitions) == 436
    assert ro2.group_index.tolist() == [0] * 16 + [1] * 16

    for mode in ("extremes", "parent_top1"):
        adv, info = transition_advantages(ro, width_keep_ratio=0.5, width_mode=mode)
        mask, step = info["train_mask"], ro.transitions.step
        assert int(mask.sum()) == 138 and info["trained_edges"] == 138.0
        assert mask[step <= 9].all() and int(mask[step > 9].sum()) == 80
        kept = [set(ro.transitions.sample_index[mask & (step == i)].tolist()) for i in range(10, 20)]
        assert all(k == kept[0] and len(k) == 8 for k in kept)  # the same 8 leaf chains at every step
    _, info = transition_advantages(ro2, width_keep_ratio=0.5)
    assert int(info["train_mask"].sum()) == 276


def test_tree_links_and_transition_chain(tiny_digits_policy):
    ro = BranchSampler(**SMALL)(tiny_digits_policy, [P3, P7], brightness, seed=0)
    ex, tr = ro.layout, ro.transitions
    assert len(tr) == 2 * 20 and ro.num_samples == 8
    par, en = ex.node_parent, ex.edge_node
    assert (par[en] == ex.edge_parent_node).all() and (ex.node_edge[en] == torch.arange(len(tr))).all()
    assert (ex.node_depth[en] == tr.step + 1).all() and (ex.node_tree[en] == tr.prompt_index).all()
    # every edge starts where the edge into its parent ended
    into_parent = ex.node_edge[par[en]]  # [M]
    has = into_parent >= 0
    assert torch.equal(tr.latents[has], tr.next_latents[into_parent[has]])
    assert torch.equal(tr.next_latents[ex.node_edge[ex.leaf_node]], ro.x0)
    # leaf ranges: tree 1's root owns samples 4..7; a leaf-chain edge names its sample
    assert ex.node_leaf_start[1] == 4 and ex.node_leaf_end[1] == 8
    late = tr.step >= 2  # children of the last split lead to one leaf each
    assert (tr.sample_index[late] >= 0).all() and (tr.sample_index[~late] == -1).all()
    assert (ro.prompt_index[tr.sample_index[late]] == tr.prompt_index[late]).all()
    # siblings at a split share the parent latent but not the sample
    first = tr.step == 0
    assert torch.equal(tr.latents[first][0], tr.latents[first][1])
    assert not torch.allclose(tr.next_latents[first][0], tr.next_latents[first][1])


# --- log-probs, noise, reproducibility -------------------------------------------------------
@pytest.mark.parametrize("step", ["dance", "sde"])
def test_rescoring_stored_edges_reproduces_old_log_prob(tiny_digits_policy, step):
    ro = BranchSampler(**SMALL, step=step)(tiny_digits_policy, [P3, P7], seed=1)
    tr = ro.transitions
    cond = index_cond(tiny_digits_policy.encode_prompts(ro.prompts), tr.prompt_index)
    v = tiny_digits_policy.velocity(tr.latents, tr.sigma, cond)  # [M, C, H, W]
    out = get_step(ro.step_type)(v, tr.latents, tr.sigma, tr.sigma_next, noise_level=ro.noise_level,
                                 prev_sample=tr.next_latents)
    assert torch.allclose(out.log_prob, tr.old_log_prob, atol=1e-4)
    if step == "dance":
        again = dance_step(v, tr.latents, tr.sigma, tr.sigma_next, noise_level=0.3, prev_sample=tr.next_latents)
        assert torch.allclose(again.log_prob, tr.old_log_prob, atol=1e-4)


def test_branch_noise_keeps_unit_marginal():
    g = torch.Generator().manual_seed(0)
    xi0, e1, e2 = (torch.randn(200_000, generator=g) for _ in range(3))
    a, b = branch_noise(xi0, e1, 4.0), branch_noise(xi0, e2, 4.0)
    assert abs(a.std().item() - 1) < 0.01 and abs(a.mean().item()) < 0.01
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item() - 1 / 17) < 0.01


def test_same_seed_same_rollout_and_other_seed_differs(tiny_digits_policy):
    s = BranchSampler(**SMALL)
    a, b = s(tiny_digits_policy, [P3], seed=5), s(tiny_digits_policy, [P3], seed=5)
    c = s(tiny_digits_policy, [P3], seed=6)
    assert torch.equal(a.x0, b.x0) and torch.equal(a.transitions.next_latents, b.transitions.next_latents)
    assert torch.equal(a.transitions.old_log_prob, b.transitions.old_log_prob)
    assert not torch.allclose(a.x0, c.x0)


def test_tree_is_independent_of_batch_mates(tiny_digits_policy):
    s = BranchSampler(**SMALL)
    alone = s(tiny_digits_policy, [P3], seeds=[11])
    both = s(tiny_digits_policy, [P7, P3], seeds=[22, 11])
    assert torch.allclose(both.x0[4:], alone.x0, atol=1e-5)
    mine = both.transitions.prompt_index == 1
    assert torch.allclose(both.transitions.next_latents[mine], alone.transitions.next_latents, atol=1e-5)
    assert torch.allclose(both.transitions.old_log_prob[mine], alone.transitions.old_log_prob, atol=1e-4)


def test_max_batch_chunks_calls_not_results(tiny_digits_policy, counting):
    from dataclasses import fields

    pol = counting(tiny_digits_policy)
    chunked = BranchSampler(**SMALL, max_batch=3)(pol, [P3, P7], seed=2)
    # 4 leaves per tree > max_batch: each tree grows as its own chunk (scored while the next grows),
    # its steps' rows in calls of at most 3
    assert pol.rows == 2 * 17 and pol.calls == 2 * sum(-(-n // 3) for n in (1, 2, 2, 4, 4, 4))
    whole = BranchSampler(**SMALL)(tiny_digits_policy, [P3, P7], seed=2)
    assert torch.allclose(chunked.x0, whole.x0, atol=1e-5)
    for f in fields(whole.layout):  # the same trees, numbered as if grown together
        a, b = getattr(whole.layout, f.name), getattr(chunked.layout, f.name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, atol=1e-4), f.name
    for f in ("prompt_index", "sample_index", "step"):
        assert torch.equal(getattr(whole.transitions, f), getattr(chunked.transitions, f)), f


# --- BranchGRPO-Mix ---------------------------------------------------------------------------
def test_mix_mode_stores_only_sde_edges(tiny_digits_policy, counting):
    s = BranchSampler(num_steps=10, split_steps=(0, 3), mode="mix", window=2, window_start=5, window_shift_every=2)
    assert s.sde_steps(0) == [0, 3, 5, 6] and s.sde_steps(2) == [0, 3, 6, 7]
    pol = counting(tiny_digits_policy)
    ro = s(pol, [P3], brightness, seed=0)
    tr, ex = ro.transitions, ro.layout
    assert pol.rows == s.evals_per_tree() == 1 + 2 * 3 + 4 * 6  # ODE steps still evaluate every latent
    assert sorted(set(tr.step.tolist())) == [0, 3, 5, 6] and len(tr) == 2 + 4 + 4 + 4 == s.edges_per_tree()
    ode_nodes = ex.node_edge == -1
    assert int(ode_nodes.sum()) == 1 + (2 * 2 + 4 * 4)  # root + nodes of the 6 ODE steps
    assert (ex.node_log_prob[ode_nodes] == 0).all() and (tr.old_log_prob != 0).all()
    adv, info = transition_advantages(ro, fusion="softmax")
    assert adv.shape == (len(tr),) and torch.isfinite(adv).all()
    ro2 = s(tiny_digits_policy, [P3], brightness, seed=0, iteration=2)
    assert sorted(set(ro2.transitions.step.tolist())) == [0, 3, 6, 7]


# --- pure tree math on a hand-built tree ------------------------------------------------------
#   0 (root, d0) -> 1 (d1) -> 2, 3 (d2);  2 -> 4, 5;  3 -> 6, 7 (leaves, d3), rewards 1, 3, 0, 4
PARENT = torch.tensor([-1, 0, 1, 1, 2, 2, 3, 3])
DEPTH = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3])
LEAVES = torch.tensor([4, 5, 6, 7])
R = torch.tensor([1.0, 3.0, 0.0, 4.0])
LP = torch.tensor([0.0, -5.0, math.log(2), 0.0, 0.0, math.log(3), 0.0, 0.0])  # edge into each node


def test_ancestor_pairs_are_leaf_membership():
    node, leaf = ancestor_pairs(PARENT, LEAVES)
    member = torch.zeros(8, 4, dtype=torch.bool)
    member[node, leaf] = True
    assert member[0].all() and member[1].all() and member[2].tolist() == [True, True, False, False]
    assert member[7].tolist() == [False, False, False, True] and len(node) == 16


def test_fusion_mean_and_softmax_by_hand():
    mean = fuse_rewards(R, PARENT, LEAVES)
    assert torch.allclose(mean, torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0, 3.0, 0.0, 4.0]))
    soft = fuse_rewards(R, PARENT, LEAVES, LP, beta_f=1.0)
    # node 2: w ∝ (1, 3) -> 2.5; node 3: w ∝ (1, 1) -> 2; node 1: w ∝ (2, 6, 1, 1) -> 24 / 10;
    # the root adds log-prob -5 to every path: shift-invariant -> also 2.4
    assert torch.allclose(soft, torch.tensor([2.4, 2.4, 2.5, 2.0, 1.0, 3.0, 0.0, 4.0]), atol=1e-6)
    half = fuse_rewards(R, PARENT, LEAVES, LP, beta_f=0.5)
    assert math.isclose(half[2].item(), (1 + 3 * math.sqrt(3)) / (1 + math.sqrt(3)), rel_tol=1e-6)
    nan = fuse_rewards(torch.tensor([1.0, float("nan"), float("nan"), float("nan")]), PARENT, LEAVES)
    assert nan[3].isnan() and nan[2] == 1.0 and nan[0] == 1.0


def test_depthwise_advantages_by_hand_with_degenerate_depths():
    adv, deg = depthwise_advantages(fuse_rewards(R, PARENT, LEAVES), DEPTH)
    # depth 0 and 1: one node; depth 2: 2 == 2, std 0 -> all 0 and degenerate
    assert adv[:4].tolist() == [0.0] * 4 and deg[:4].all() and not deg[4:].any()
    std = math.sqrt((1 + 1 + 4 + 4) / 3)  # unbiased, mean 2
    assert torch.allclose(adv[4:], torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (std + 1e-8), atol=1e-6)
    soft, _ = depthwise_advantages(fuse_rewards(R, PARENT, LEAVES, LP, beta_f=1.0), DEPTH)
    s2 = math.sqrt(2 * 0.25**2)  # depth 2 = (2.5, 2.0): mean 2.25, unbiased std 0.3536
    assert torch.allclose(soft[2:4], torch.tensor([0.25, -0.25]) / s2, atol=1e-5)  # +-0.7071
    # two trees in one batch: normalised separately (the second's rewards are shifted by 100)
    vals = torch.cat([fuse_rewards(R, PARENT, LEAVES), fuse_rewards(R + 100, PARENT, LEAVES)])
    two, _ = depthwise_advantages(vals, torch.cat([DEPTH, DEPTH]), torch.tensor([0] * 8 + [1] * 8))
    assert torch.allclose(two[:8], two[8:], atol=1e-5) and torch.allclose(two[:8], adv, atol=1e-6)


def test_edge_advantages_clip():
    assert edge_advantages(torch.tensor([0.0, 7.0, -9.0, 1.5]), torch.tensor([3, 1, 2])).tolist() == [1.5, 5.0, -5.0]


def test_width_pruning_modes_by_hand():
    adv = torch.tensor([0.5, -1.0, 2.0, 0.1, -0.3, 1.5, -2.0, 0.0, 9.0])
    step = torch.tensor([5] * 8 + [2])  # the last edge is before the last split (3): always kept
    tree = torch.zeros(9, dtype=torch.long)
    keep = width_prune_mask(adv, step, tree, 3, 0.5, "extremes")
    assert torch.nonzero(keep).flatten().tolist() == [1, 2, 5, 6, 8]  # top 2.0, 1.5; bottom -2, -1
    parents = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, -1])
    keep = width_prune_mask(adv, step, parents, 3, 0.5, "parent_top1")
    assert torch.nonzero(keep).flatten().tolist() == [0, 2, 5, 7, 8]
    assert width_prune_mask(adv, step, tree, 3, 1.0).all()


def test_depth_window_slides_and_wraps():
    depth = torch.arange(1, 21)  # edges of steps 0..19
    for it, first in [(0, 1), (29, 1), (30, 2), (60, 3), (17 * 30, 1)]:
        mask, start = depth_window_mask(depth, 20, 4, it, 30)
        assert start == first and torch.nonzero(mask).flatten().add(1).tolist() == list(range(first, first + 4))


# --- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(split_steps=(0, 20)), "in \\[0, num_steps - 1\\]"),
    (dict(split_steps=(-1, 3)), "split_steps must be an integer >= 0 or a list"),
    (dict(split_steps=(3, 0)), "sorted"),
    (dict(split_steps=(0, 3, 3)), "duplicates"),
    (dict(split_steps=()), "at least one split"),
    (dict(split_steps=(0.5,)), "split_steps must be an integer >= 0 or a list"),
    (dict(branch_factor=1), "branch_factor"),
    (dict(mode="tree"), "mode must be one of 'sde', 'mix'"),
    (dict(step="ode"), "stochastic step"),
    (dict(step="ddim"), "Valid step types"),
    (dict(noise_level=0.0), "noise_level"),
    (dict(branch_noise_mix=0.0), "branch_noise_mix"),
    (dict(mode="mix", window=0), "window"),
    (dict(num_steps=0), "num_steps"),
    (dict(max_batch=0), "max_batch"),
])
def test_bad_sampler_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BranchSampler(**kwargs)


def test_bad_calls_and_options_raise(tiny_digits_policy):
    s = BranchSampler(**SMALL)
    with pytest.raises(ValueError, match="prompts is empty"):
        s(tiny_digits_policy, [])
    with pytest.raises(ValueError, match="one seed per tree"):
        s(tiny_digits_policy, [P3, P7], seeds=[1])
    ro = s(tiny_digits_policy, [P3], brightness, seed=0, iteration=0)
    for kw, match in [(dict(fusion="max"), "unknown fusion"), (dict(beta_f=1.0), "fusion='softmax'"),
                      (dict(width_keep_ratio=0.5, width_mode="random"), "unknown width_mode"),
                      (dict(width_keep_ratio=0.0), "width_keep_ratio"), (dict(depth_window=7), "depth_window")]:
        with pytest.raises(ValueError, match=match):
            branch_structure(ro, **kw)
    adv, info = branch_structure(ro, some_trainer_option=1, iteration=3)  # unknown options are ignored
    assert adv.dtype == torch.float32 and info["train_mask"].all()
