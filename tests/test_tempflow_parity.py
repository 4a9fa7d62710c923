"""TempFlow-GRPO parity: the ``*_tracker`` groupings against a hand-written reference, and the
noise-aware step weights against the constants of the peer's public training scripts.

The reference below is written from the formula of Flow-GRPO's per-prompt stat tracker as the
TempFlow-GRPO code applies it to its ``[rows, steps]`` table of process rewards (arXiv 2508.04324):
per prompt text and per step column, ``A = (R - mean) / (population std + 1e-4)`` in float64,
``global_std`` = the std of the whole step column; clipped to +-5 by the trainer; a row whose
advantages are 0 at every step is not trained. Plain Python loops, no torch, on purpose.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages import transition_advantages
from flowrl.advantages.tempflow import (GROUP_BY, tempflow_groups, tempflow_structure, tracker_advantages,
                                        zero_rows)
from flowrl.rollout import TempFlowSampler
from flowrl.structures import TempFlowStructure

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread

EPS, CLIP = 1e-4, 5.0
# prompts 0 and 2 are the same text: the tracker pools them, flowrl's "prompt" grouping does not
PROMPTS = ["a cat", "a dog", "a cat"]
SEEDS, BRANCHES, STEPS = 3, 3, (0, 1, 3)  # branch steps of a T = 4 schedule


def table_rollout(reward_of, prompts=PROMPTS, seeds=SEEDS, branches=BRANCHES, steps=STEPS):
    """A TempFlow-shaped rollout with no model: one transition per (prompt, seed, step, branch),
    in the sampler's order, whose process reward is ``reward_of(p, s, k, b)``."""
    rows = [(p, s, k, b) for p in range(len(prompts)) for s in range(seeds) for k in steps for b in range(branches)]
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    rewards = torch.tensor([reward_of(*r) for r in rows], dtype=torch.float32)  # [N]
    return SimpleNamespace(
        structure="tempflow", prompts=list(prompts), rewards=rewards, reward_components={"r": rewards.clone()},
        transitions=SimpleNamespace(prompt_index=long([r[0] for r in rows]), sample_index=torch.arange(len(rows))),
        layout=TempFlowStructure(trajectory=long([r[0] * seeds + r[1] for r in rows]),
                                 seed_slot=long([r[1] for r in rows]), step=long([r[2] for r in rows]),
                                 branch=long([r[3] for r in rows]), group_by="seed", branch_steps=list(steps))), rows


def irregular(p, s, k, b):
    """Fixed rewards with different means and spreads per prompt and seed."""
    return round(math.sin(1.7 * p + 0.9 * s * s + 0.37 * k + 1.3 * b) + 0.8 * s - 0.3 * p * k, 4)


def reference_tracker(rows, rewards, key, global_std=False):
    """Hand transcription of the tracker on the process-reward table: ``key(row)`` names the group."""
    cells = {}
    for i, (p, s, k, b) in enumerate(rows):
        cells.setdefault((key(p, s), k), []).append(i)
    col_std = {}
    for k in {r[2] for r in rows}:
        xs = [rewards[i] for i, r in enumerate(rows) if r[2] == k]
        m = sum(xs) / len(xs)
        col_std[k] = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    adv = [0.0] * len(rows)
    for (g, k), members in cells.items():
        xs = [rewards[i] for i in members]
        mean = sum(xs) / len(xs)
        std = col_std[k] if global_std else math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        for i in members:
            a = (rewards[i] - mean) / (std + EPS)
            adv[i] = max(-CLIP, min(CLIP, a))
    skipped = {}
    for i, (p, s, k, b) in enumerate(rows):  # a table row: one (seed, branch) across its steps
        skipped[(p, s, b)] = skipped.get((p, s, b), True) and adv[i] == 0.0
    return adv, [skipped[(p, s, b)] for (p, s, k, b) in rows]


PROMPT_TEXT = lambda p, s: PROMPTS[p]  # noqa: E731
SEED = lambda p, s: (p, s)  # noqa: E731


@pytest.mark.parametrize("group_by, key", [("prompt_tracker", PROMPT_TEXT), ("seed_tracker", SEED)])
@pytest.mark.parametrize("global_std", [False, True])
def test_tracker_matches_reference(group_by, key, global_std):
    r, rows = table_rollout(irregular)
    adv, info = tempflow_structure(r, group_by=group_by, global_std=global_std)
    ref, ref_skip = reference_tracker(rows, r.rewards.double().tolist(), key, global_std)
    assert adv.dtype == torch.float32 and adv.shape == (len(rows),)
    assert torch.allclose(adv, torch.tensor(ref, dtype=torch.float32), atol=1e-5)
    assert info["zero_var"].tolist() == ref_skip and not any(ref_skip)
    cells = {(key(p, s), k) for p, s, k, b in rows}
    assert info["num_groups"] == len(cells) == {"prompt_tracker": 6, "seed_tracker": 27}[group_by]
    # the registry takes the option too (as train.loss_options.advantage_options.group_by)
    assert torch.equal(transition_advantages(r, group_by=group_by, global_std=global_std)[0], adv)


def test_seed_grouping_differs_from_the_tracker():
    """flowrl's default ``seed`` normalises within one initial noise; the tracker on the same table
    pools every seed (and every entry with the same prompt text) of a step."""
    r, rows = table_rollout(irregular)
    seed, _ = tempflow_structure(r, group_by="seed")
    tracker, _ = tempflow_structure(r, group_by="prompt_tracker")
    ref, _ = reference_tracker(rows, r.rewards.double().tolist(), PROMPT_TEXT)
    assert (seed - tracker).abs().max() > 0.5
    assert (seed - torch.tensor(ref)).abs().max() > 0.5
    # "prompt" pools seeds but keys by prompt index: the duplicated text "a cat" still differs
    prompt, _ = tempflow_structure(r, group_by="prompt")
    dup = torch.tensor([p != 1 for p, *_ in rows])
    assert (prompt - tracker)[dup].abs().max() > 0.05
    assert torch.allclose(prompt[~dup], tracker[~dup], atol=1e-5)  # "a dog" appears once: same


def test_seed_tracker_equals_seed_without_ties():
    """Same formula as flowrl's ``seed`` grouping (population std + 1e-4, clip 5) when no cell is constant."""
    r, _ = table_rollout(irregular)
    a, _ = tempflow_structure(r, group_by="seed")
    b, _ = tempflow_structure(r, group_by="seed_tracker")
    assert torch.allclose(a, b, atol=1e-5)
    # ... but global_std is per step column in the tracker, pooled over every step in flowrl
    a, _ = tempflow_structure(r, group_by="seed", global_std=True)
    b, _ = tempflow_structure(r, group_by="seed_tracker", global_std=True)
    assert (a - b).abs().max() > 0.05


def test_constant_cells_and_rows():
    """A constant cell gets A = 0 but is still trained; a row with A = 0 at every step is skipped."""
    def reward(p, s, k, b):
        if p == 1 and s == 0:
            return 0.5  # every cell of this initial noise is constant
        return 0.25 if k == 1 else irregular(p, s, k, b)  # step 1 is constant for everyone else

    r, rows = table_rollout(reward)
    for group_by, key in [("seed_tracker", SEED), ("prompt_tracker", PROMPT_TEXT)]:
        adv, info = tempflow_structure(r, group_by=group_by)
        ref, ref_skip = reference_tracker(rows, r.rewards.double().tolist(), key)
        assert torch.allclose(adv, torch.tensor(ref, dtype=torch.float32), atol=1e-5)
        assert info["zero_var"].tolist() == ref_skip
        cell = (r.layout.step == 1) & (r.transitions.prompt_index != 1)  # constant cells
        assert (adv[cell] == 0).all() and not info["zero_var"][cell].any()
    own = (r.transitions.prompt_index == 1) & (r.layout.trajectory == 1 * SEEDS + 0)
    _, info = tempflow_structure(r, group_by="seed_tracker")
    assert torch.equal(info["zero_var"], own)  # the only all-zero rows: prompt 1, seed 0
    _, info_seed = tempflow_structure(r, group_by="seed")  # flowrl skips every constant cell instead
    assert info_seed["zero_var"][r.layout.step == 1].all() and info_seed["zero_var"].sum() > own.sum()


def test_clip_and_reward_components():
    r, rows = table_rollout(lambda p, s, k, b: 100.0 if (s, b) == (0, 0) else 0.0, seeds=1, branches=40)
    adv, _ = tempflow_structure(r, group_by="seed_tracker")
    assert adv.max() == CLIP  # (100 - 2.5) / (15.6 + 1e-4) = 6.2 before the clip
    assert tempflow_structure(r, group_by="seed_tracker", adv_clip=10.0)[0].max() > CLIP
    r, _ = table_rollout(irregular)
    r.reward_components = {"a": r.rewards.clone(), "b": -2 * r.rewards}
    mixed, _ = tempflow_structure(r, group_by="prompt_tracker", per_reward_weights={"a": 1.0, "b": 0.5})
    single, _ = tempflow_structure(r, group_by="prompt_tracker")
    assert torch.allclose(mixed, 0.5 * single, atol=1e-3)  # b = -2 a normalises to about -A: A - 0.5 A


def test_pure_function_shapes_and_nan():
    rewards = torch.tensor([1.0, 2.0, float("nan"), 4.0, 2.0, 3.0])  # [6]; row 2: NaN, then the mean
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    steps = torch.tensor([0, 0, 0, 1, 1, 1])
    rows = torch.tensor([0, 1, 2, 0, 1, 2])
    adv, zero = tracker_advantages(rewards, groups, steps, rows)
    assert adv[2] == 0 and torch.isfinite(adv).all()
    assert torch.allclose(adv[:2], torch.tensor([-0.5, 0.5]) / (0.5 + EPS))
    assert torch.equal(zero, torch.tensor([False, False, True, False, False, True]))
    assert torch.equal(zero_rows(torch.tensor([0.0, 1.0, 0.0]), torch.tensor([4, 4, 7])),
                       torch.tensor([False, False, True]))


def test_sampler_tracker_groupings(tiny_digits_policy):
    cfg = dict(num_steps=3, branches=2, seeds_per_prompt=2)
    prompts = ["a handwritten digit 3", "a handwritten digit 3", "a handwritten digit 7"]
    reward = lambda im, p, **_: im.mean(dim=(1, 2, 3))  # noqa: E731
    r = TempFlowSampler(**cfg, group_by="prompt_tracker")(tiny_digits_policy, prompts, reward, seed=1)
    assert r.layout.group_by == "prompt_tracker"
    assert torch.unique(r.group_index).numel() == 2 * 2  # 2 prompt texts x 2 branch steps
    lay, tr = r.layout, r.transitions
    rows = list(zip(tr.prompt_index.tolist(), lay.seed_slot.tolist(), lay.step.tolist(), lay.branch.tolist()))
    ref, _ = reference_tracker(rows, r.rewards.double().tolist(), lambda p, s: prompts[p])
    adv, _ = transition_advantages(r)  # the sampler's group_by is the default
    assert torch.allclose(adv, torch.tensor(ref, dtype=torch.float32), atol=1e-5)
    s = TempFlowSampler(**cfg, group_by="seed_tracker")(tiny_digits_policy, prompts, reward, seed=1)
    assert torch.unique(s.group_index).numel() == 3 * 2 * 2  # (prompt, seed) x step
    assert TempFlowSampler(branches=1, seeds_per_prompt=2, group_by="prompt_tracker").branches == 1


def tempflow_code_weights(sigmas, trained, constant, code_noise_level=0.7):
    """The TempFlow-GRPO scripts' loss weight of step k (``train_sd3_pr.py`` / ``train_flux_pr.py``):
    ``constant * std_dev_t * sqrt(-dt)`` with ``std_dev_t = a sqrt(sigma / (1 - sigma'))``, ``sigma' =``
    the next sigma at sigma = 1, and ``a`` fixed to 0.7 in the SDE step both scripts use (its comment
    reads "In SD3.5-M, 0.7. In FLUX, 0.9"); ``constant`` 2.25 (SD3.5-M) or 1.73 (FLUX)."""
    out = []
    for k in trained:
        s, sn = float(sigmas[k]), float(sigmas[k + 1])
        std_dev_t = code_noise_level * math.sqrt(s / (1 - (sn if s == 1 else s)))
        out.append(constant * std_dev_t * math.sqrt(s - sn))
    return torch.tensor(out)


def test_noise_aware_weights_against_the_peer_scripts_constants():
    """SD3.5-M (shift 3, T = 10, 2.25 at a = 0.7): flowrl's weights equal the script's. FLUX (1024 px,
    T = 10): the script's 1.73 is 1 / mean(step scale) at a = 0.9, but its SDE step runs at a = 0.7, so
    its weights are 0.7 / 0.9 of what the constant was made for: flowrl's equal the peer's formula at
    0.9 and are 1.28x the peer's code at 0.7, every step alike (flowrl's weights average 1 at any a)."""
    from flowrl.noise import noise_aware_weights
    from flowrl.schedules import flow_sigmas, flux_sigmas

    trained = range(9)  # the scripts train steps 0..8 of 10 (timestep_fraction 0.9)
    sd3 = flow_sigmas(10, 3.0)
    ours = noise_aware_weights(sd3, 0.7, trained)[:9]
    torch.testing.assert_close(ours, tempflow_code_weights(sd3, trained, 2.25), rtol=2e-3, atol=0)
    flux = flux_sigmas(10, (1024 // 16) ** 2)  # 4096 packed latent tokens at 1024 px
    for a in (0.7, 0.9):  # flowrl's FLUX weights for either noise level
        ours = noise_aware_weights(flux, a, trained)[:9]
        as_commented = tempflow_code_weights(flux, trained, 1.73, code_noise_level=0.9)
        as_run = tempflow_code_weights(flux, trained, 1.73)  # a = 0.7, hard-coded
        torch.testing.assert_close(ours, as_commented, rtol=3e-3, atol=0)
        ratio = ours / as_run  # [9]
        assert torch.allclose(ratio, ratio.mean(), rtol=1e-5)  # the same factor at every step
        assert abs(float(ratio.mean()) - 1.2827) < 5e-4  # (0.9 / 0.7) x (1.726 / 1.73)


@pytest.mark.parametrize("bad", ["tracker", "Prompt", "per_prompt"])
def test_bad_group_by_names_the_choices(bad):
    r, _ = table_rollout(irregular)
    for call in (lambda: tempflow_structure(r, group_by=bad), lambda: tempflow_groups(r, bad),
                 lambda: TempFlowSampler(group_by=bad)):
        with pytest.raises(ValueError, match="group_by must be one of") as e:
            call()
        assert all(name in str(e.value) for name in GROUP_BY)
    with pytest.raises(ValueError, match="needs >= 2 .*seeds_per_prompt"):
        TempFlowSampler(branches=1, seeds_per_prompt=1, group_by="prompt_tracker")
    with pytest.raises(ValueError, match="needs >= 2 \\(raise branches\\)"):
        TempFlowSampler(branches=1, seeds_per_prompt=4, group_by="seed_tracker")
