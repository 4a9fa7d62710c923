from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages import combine_component_advantages, group_advantages


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a, zero = group_advantages(r, g)
    std = torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False)
    assert torch.allclose(a[:3], (torch.tensor([1.0, 2.0, 3.0]) - 2) / (std + 1e-4))
    assert torch.all(a[3:] == 0) and zero.tolist() == [False] * 3 + [True] * 3


def test_global_std_and_clip():
    r = torch.tensor([0.0, 1.0, 0.0, 100.0])
    g = torch.tensor([0, 0, 1, 1])
    a, _ = group_advantages(r, g, global_std=True)
    gstd = r.std(unbiased=False)
    assert torch.allclose(a[:2], torch.tensor([-0.5, 0.5]) / (gstd + 1e-4))
    # one outlier among 50: unclipped advantages +7 (= sqrt(49)) and -7, beyond the clip of 5
    r = torch.zeros(100)
    r[0], r[50:] = 1.0, 1.0
    r[99] = 0.0
    g = torch.tensor([0] * 50 + [1] * 50)
    a2, _ = group_advantages(r, g)
    assert a2[0].item() == 5.0 and a2[99].item() == -5.0  # clipped exactly
    assert torch.allclose(a2[1:50], torch.full((49,), -1 / 7), atol=1e-3)  # the others untouched
    assert group_advantages(r, g, clip=3.0)[0][[0, 99]].tolist() == [3.0, -3.0]
    assert 6.9 < group_advantages(r, g, clip=10.0)[0][0] < 7.0  # a clip above 5 is honoured


def test_nan_rewards_ignored():
    r = torch.tensor([1.0, float("nan"), 3.0, float("nan"), float("nan")])
    g = torch.tensor([0, 0, 0, 1, 1])
    a, zero = group_advantages(r, g)
    assert a[1] == 0 and torch.isfinite(a).all()
    assert a[0] < 0 < a[2] and zero.tolist() == [False, False, False, True, True]


def test_per_reward_normalisation():
    comps = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([0.0, 100.0])}
    a, _ = combine_component_advantages(comps, {"a": 1.0, "b": 1.0}, torch.tensor([0, 0]))
    # each reward contributes +-1 (before its +1e-4), whatever its scale
    assert torch.allclose(a, torch.tensor([-2.0, 2.0]), atol=1e-3)


def test_registry_dispatches_every_structure_to_its_function():
    """``transition_advantages`` serves each structure name a sampler's record can carry, and maps a
    group rollout's sample advantages onto its transitions (by ``sample_index``, hand-computed)."""
    from flowrl.advantages import ADVANTAGES, transition_advantages
    from flowrl.structures import Structure

    def subclasses(cls):
        return {cls} | {s for c in cls.__subclasses__() for s in subclasses(c)}

    names = {c.name for c in subclasses(Structure) if c.name}
    assert names == {"group", "branch", "tempflow"} and names <= set(ADVANTAGES)
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])  # group 0 varies, group 1 is constant
    view = SimpleNamespace(structure="group", rewards=r, group_index=torch.tensor([0, 0, 0, 1, 1, 1]),
                           reward_components={}, transitions=SimpleNamespace(sample_index=torch.tensor([2, 0, 0, 4])))
    adv, info = transition_advantages(view)
    a = 1 / (torch.tensor([1.0, 2.0, 3.0]).std(unbiased=False) + 1e-4)  # (3 - 2) / (std + eps)
    assert torch.allclose(adv, torch.stack([a, -a, -a, torch.tensor(0.0)]))
    assert info["zero_var"].tolist() == [False, False, False, True]
    with pytest.raises(ValueError, match=r"unknown rollout structure 'nope'.* Valid rollout structures: branch, group"):
        transition_advantages(SimpleNamespace(structure="nope"))


def test_public_names_named_by_the_issues_are_the_ones_in_use(tiny_digits_policy):
    """The rollout classes importable from ``flowrl.rollout`` are the registry's samplers, and
    ``flowrl.noise.noise_aware_weights`` gives the weights a TempFlow rollout trains with."""
    from flowrl.noise import noise_aware_weights
    from flowrl.registry import SAMPLERS
    from flowrl.rollout import BranchSampler, GroupSampler, SolSampler, TempFlowSampler

    classes = {"group": GroupSampler, "branch": BranchSampler, "tempflow": TempFlowSampler, "sol": SolSampler}
    assert all(SAMPLERS.get(name) is cls for name, cls in classes.items())
    sampler = TempFlowSampler(num_steps=3, branch_steps=[0, 1], branches=2, seeds_per_prompt=1, noise_level=0.8)
    r = sampler(tiny_digits_policy, ["a handwritten digit 1"], seed=0)
    w = noise_aware_weights(r.sigmas, 0.8, [0, 1])  # [3]
    assert torch.equal(r.layout.step_weights, w) and w[0] != w[1]
    assert torch.equal(r.transitions.weight, w[r.transitions.step])
