"""Advantage and ratio clips are reached, exact, and follow ``train.loss_options.adv_clip_max``.

Every input here has unclipped values beyond the clip, so each test fails if the clamp it
names is removed from the source (checked by mutation when written).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages.tree import branch_structure
from flowrl.losses import grpo_clipped_loss
from flowrl.trainers.config import load_config
from flowrl.structures import TreeStructure
from flowrl.updates.grpo import GRPOUpdate

ROOT = Path(__file__).resolve().parents[1]
OUTLIER = 1.0  # one reward of 1 among 49 zeros: unclipped advantage about +6.9 (> 5)


def _star_tree(n_leaves: int = 50):
    """One root (depth 0) with ``n_leaves`` leaf children; leaf 0 scores 1, the others 0."""
    rewards = torch.zeros(n_leaves)  # [L]
    rewards[0] = OUTLIER
    parent = torch.tensor([-1] + [0] * n_leaves)  # [nodes]
    nodes = torch.arange(1, n_leaves + 1)  # [L]
    layout = TreeStructure.from_tree(parent, (parent >= 0).long(), torch.zeros(n_leaves + 1).long(),
                                     torch.zeros(n_leaves + 1), torch.cat([torch.tensor([-1]), nodes - 1]), nodes,
                                     n_leaves, tree_seeds=[0], split_steps=[0], branch_factor=n_leaves, num_steps=1,
                                     sde_steps=[0])
    return SimpleNamespace(structure="branch", rewards=rewards, layout=layout, reward_components={},
                           transitions=SimpleNamespace(step=torch.zeros(n_leaves).long(), sample_index=nodes - 1))


def test_branch_structure_clips_at_adv_clip():
    ro = _star_tree()
    a5, _ = branch_structure(ro)
    assert a5[0].item() == 5.0  # default clip reached
    a10, _ = branch_structure(ro, adv_clip=10.0)
    assert 6.8 < a10[0].item() < 7.0  # unbiased depth std: 0.98 / sqrt(0.98 / 49) = 6.93, not cut at 5
    a3, _ = branch_structure(ro, adv_clip=3.0)
    assert a3[0].item() == 3.0 and torch.equal(a3[1:], a10[1:])  # only the outlier is clipped


def _update_stub(adv_clip_max: float):
    """A GRPO update whose context holds only what ``advantages`` reads (one process)."""
    cfg = load_config(ROOT / "recipes/digits.yaml", [f"train.loss_options.adv_clip_max={adv_clip_max}"])
    return GRPOUpdate(SimpleNamespace(train=cfg.train, reward=cfg.reward, num_processes=1, process_index=0),
                      cfg.train.update_options)


@pytest.mark.parametrize("clip", [2.0, 10.0])
def test_per_reward_sums_are_clipped_once_more(clip):
    # two rewards weighted 1 each, both with the outlier at row 0: each component's advantage is
    # clipped, their sum (up to 2 x 6.93) is clipped to adv_clip_max again, once, by the structure
    r = torch.zeros(50)
    r[0] = OUTLIER
    ro = SimpleNamespace(structure="group", rewards=r, group_index=torch.zeros(50).long(),
                         reward_components={"a": r.clone(), "b": r.clone()},
                         transitions=SimpleNamespace(sample_index=torch.arange(50)))
    upd = _update_stub(clip)
    upd.ctx.reward.aggregate, upd.ctx.reward.weights = "per_reward", {"a": 1.0, "b": 1.0}
    adv, _ = upd.advantages(ro, 0)
    assert adv[0].item() == clip  # 2 x min(6.93, clip) > clip: cut to the clip
    assert -clip < adv[1].item() < 0 and adv.abs().max().item() == clip


def test_trainer_group_advantages_above_5_are_not_cut_at_5():
    r = torch.zeros(50)
    r[0] = OUTLIER
    ro = SimpleNamespace(structure="group", rewards=r, group_index=torch.zeros(50).long(), reward_components={},
                         transitions=SimpleNamespace(sample_index=torch.arange(50)))
    adv10, _ = _update_stub(10.0).advantages(ro, 0)
    assert 6.9 < adv10[0].item() < 7.0  # sqrt(49) = 7 (population std + 1e-4)
    adv5, _ = _update_stub(5.0).advantages(ro, 0)
    assert adv5[0].item() == 5.0


def test_grpo_ratio_clip_is_reached():
    # ratio 2 (beyond 1 + 0.2): with A > 0 the clipped term is the max -> -A * 1.2
    lp, old = torch.log(torch.tensor([2.0, 0.5])), torch.zeros(2)
    adv = torch.tensor([1.0, -1.0])  # second row: ratio 0.5 < 0.8, A < 0 -> -(-1) * 0.8 = 0.8
    loss, stats = grpo_clipped_loss(lp, old, adv, 0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clip_fraction"] == 1.0
    # the clip is one-sided: A > 0 and ratio < 1 - eps keeps the unclipped (larger) term -A r = -0.5
    loss, _ = grpo_clipped_loss(torch.log(torch.tensor([0.5])), torch.zeros(1), torch.tensor([1.0]), 0.2)
    assert loss.item() == pytest.approx(-0.5)


def test_nft_clips_its_advantages_once_in_the_loss():
    from flowrl.losses import nft_loss

    # DiffusionNFT clips A to +-Amax inside its loss (then scales by Amax): A = 7 with Amax = 5 is 5
    x0, v_old = torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    x_t, v, t = torch.ones(1, 1, 2, 2), torch.full((1, 1, 2, 2), 0.5), torch.tensor([0.5])
    at = lambda a, m: nft_loss(v, v_old, x_t, x0, t, torch.tensor([a]), adv_clip_max=m)[0]  # noqa: E731
    assert torch.equal(at(7.0, 5.0), at(5.0, 5.0)) and not torch.equal(at(4.0, 5.0), at(5.0, 5.0))
    assert not torch.equal(at(7.0, 10.0), at(5.0, 10.0))  # not cut at 5 above it


@pytest.mark.parametrize("group_by", ["seed", "prompt"])
@pytest.mark.parametrize("per_reward", [False, True])
def test_tempflow_cell_groupings_honour_adv_clip_above_5(group_by, per_reward):
    from flowrl.advantages.tempflow import tempflow_structure
    from flowrl.structures import TempFlowStructure

    # 1 prompt, 1 initial noise, 2 branch steps x 40 branches; one branch scores 100: unclipped A = 6.2
    n = 40
    r = torch.zeros(2 * n)
    r[0] = 100.0
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    ro = SimpleNamespace(structure="tempflow", prompts=["a cat"], rewards=r, reward_components={"r": r.clone()},
                         transitions=SimpleNamespace(prompt_index=torch.zeros(2 * n).long(),
                                                     sample_index=torch.arange(2 * n)),
                         layout=TempFlowStructure(trajectory=torch.zeros(2 * n).long(),
                                                  seed_slot=torch.zeros(2 * n).long(), step=long([0] * n + [1] * n),
                                                  branch=long(list(range(n)) * 2), group_by=group_by,
                                                  branch_steps=(0, 1)))
    kw = {"per_reward_weights": {"r": 1.0}} if per_reward else {}
    assert tempflow_structure(ro, adv_clip=5.0, **kw)[0].max().item() == 5.0
    assert 6.2 < tempflow_structure(ro, adv_clip=10.0, **kw)[0].max().item() < 6.3
