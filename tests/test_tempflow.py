"""TempFlow-GRPO (docs/algorithms.md §5): sampler, noise-aware weights, per-step advantages."""

import pytest
import torch

from flowrl.advantages import transition_advantages
from flowrl.advantages.tempflow import tempflow_structure
from flowrl.noise import noise_aware_weights, step_noise_scales
from flowrl.rollout import GroupSampler, TempFlowSampler
from flowrl.schedules import flow_sigmas
from flowrl.sde import STEPS, ode_step
from flowrl.types import index_cond

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]
SMALL = dict(num_steps=4, branches=3, seeds_per_prompt=2)  # B = (0, 1, 2): 36 completions for 2 prompts


def mean_reward(images, prompts, **_):
    return images.mean(dim=(1, 2, 3))  # [N]


@pytest.fixture
def small_rollout(tiny_digits_policy):
    sampler = TempFlowSampler(**SMALL)
    return sampler, sampler(tiny_digits_policy, PROMPTS, mean_reward, seed=5)


# --- noise-aware weights -------------------------------------------------------------------
def test_noise_aware_weights_spec_figures():
    sig = flow_sigmas(10, 3.0)  # SD3.5-M: diffusers schedule, shift 3, T = 10
    trained = range(9)
    for a, normaliser in [(0.7, 2.25), (0.9, 1.75)]:
        scales = step_noise_scales(sig, a)  # [10]
        assert abs(1 / scales[:9].mean().item() - normaliser) < 0.01
        # hand formula: std_t = a sqrt(s / (1 - s')), s' = sigma_next at sigma == 1
        s, sn = sig[:-1].double(), sig[1:].double()
        std = a * torch.sqrt(s / (1 - torch.where(s == 1, sn, s)))
        assert torch.allclose(scales.double(), std * torch.sqrt(s - sn), atol=1e-6)
    w = noise_aware_weights(sig, 0.7, trained)  # [10]
    assert w.dtype == torch.float32 and w.shape == (10,)
    assert abs(w[:9].mean().item() - 1) < 1e-6 and w[9] == 0
    assert abs(w[0].item() - 1.6) < 0.05 and abs(w[8].item() - 0.5) < 0.05  # docs/algorithms.md: ~1.6 -> ~0.5
    assert torch.all(w[2:9][1:] < w[2:9][:-1])  # decreasing after the second step
    assert w[1] > w[0]  # the first step's std_t uses 1 - sigma_next: step 1 is the largest (1.673)
    assert torch.allclose(noise_aware_weights(sig, 0.9, trained), w, atol=1e-6)  # independent of a
    sub = noise_aware_weights(sig, 0.7, [2, 5])
    assert abs(sub[[2, 5]].mean().item() - 1) < 1e-6 and sub.count_nonzero() == 2


@pytest.mark.parametrize("kw, match", [(dict(noise_level=0.0), "noise_level"), (dict(trained_steps=[]), "empty"),
                                       (dict(trained_steps=[1, 1]), "duplicates"),
                                       (dict(trained_steps=[10]), "outside")])
def test_noise_aware_weights_errors(kw, match):
    args = dict(sigmas=flow_sigmas(10, 3.0), noise_level=0.7, trained_steps=range(9)) | kw
    with pytest.raises(ValueError, match=match):
        noise_aware_weights(**args)


# --- sampler -------------------------------------------------------------------------------
def test_one_transition_per_completion(small_rollout, tiny_digits_policy):
    sampler, r = small_rollout
    p, s, e, nb, t = 2, 2, 3, 3, 4
    n = p * s * e * nb
    tr, ex = r.transitions, r.layout
    assert r.structure == "tempflow" and r.step_type == "sde" and r.noise_level == 0.7
    assert r.num_samples == n == len(tr) == sampler.num_completions(p)
    assert torch.equal(tr.sample_index, torch.arange(n))
    keys = set(zip(tr.prompt_index.tolist(), ex.seed_slot.tolist(), ex.step.tolist(), ex.branch.tolist()))
    assert len(keys) == n and keys == {(a, b, c, d) for a in range(p) for b in range(s) for c in range(nb) for d in range(e)}
    assert torch.equal(tr.step, ex.step) and torch.equal(r.prompt_index, tr.prompt_index)
    assert torch.equal(tr.sigma, r.sigmas[tr.step]) and torch.equal(tr.sigma_next, r.sigmas[tr.step + 1])
    assert torch.all(tr.old_log_prob != 0) and torch.isfinite(tr.old_log_prob).all()
    assert torch.allclose(r.rewards, mean_reward(r.images, None)) and r.images.shape == (n, 3, 16, 16)

    # transitions start on the main ODE trajectory (recomputed here one row at a time)
    pol = tiny_digits_policy
    cond = pol.encode_prompts(PROMPTS)
    seeds = r.seeds[ex.trajectory.argsort(stable=True)][:: e * nb].tolist()  # [P * S] per main row
    x = pol.initial_noise(seeds)  # [J, 1, 16, 16]
    rows = torch.arange(p).repeat_interleave(s)
    main = [x]
    for i in range(t - 1):
        v = pol.velocity(x, r.sigmas[i].expand(len(x)), index_cond(cond, rows))
        x = ode_step(v, x, r.sigmas[i], r.sigmas[i + 1]).sample
        main.append(x)
    for m in range(n):
        assert torch.allclose(tr.latents[m], main[int(tr.step[m])][int(ex.trajectory[m])], atol=1e-5)
    # ...and each completion is the ODE continuation of its child
    m = int(((ex.step == 0) & (ex.branch == 1)).nonzero()[0])
    y = tr.next_latents[m : m + 1]
    for i in range(1, t):
        v = pol.velocity(y, r.sigmas[i].expand(1), index_cond(cond, tr.prompt_index[m : m + 1]))
        y = ode_step(v, y, r.sigmas[i], r.sigmas[i + 1]).sample
    assert torch.allclose(y, r.x0[m : m + 1], atol=1e-5)


@pytest.mark.parametrize("cfg, num_prompts", [
    (dict(SMALL), 2),
    (dict(SMALL, finish_main=True, max_batch=7), 1),
    (dict(num_steps=5, branch_steps=[3, 1], branches=2, seeds_per_prompt=3), 2),
    (dict(num_steps=3, branch_steps=[2], branches=2, seeds_per_prompt=1), 1),  # branch at the last step
])
def test_model_evals_closed_form(tiny_digits_policy, counting, cfg, num_prompts):
    """Rows through the model = P S (T_main + E sum_{k in B} (T - 1 - k)): the child's SDE step
    from x_k reuses the main velocity at x_k; T_main = T with finish_main, else max(B) + 1."""
    sampler = TempFlowSampler(**cfg)
    pol = counting(tiny_digits_policy)
    r = sampler(pol, PROMPTS[:num_prompts], mean_reward, seed=0)
    t, e, s, b = sampler.num_steps, sampler.branches, sampler.seeds_per_prompt, sampler.branch_steps
    t_main = t if sampler.finish_main else max(b) + 1
    expected = num_prompts * s * (t_main + e * sum(t - 1 - k for k in b))
    assert pol.rows == r.stats["model_evals"] == sampler.model_evals(num_prompts) == expected
    if sampler.max_batch is None:
        assert pol.calls == t  # every live latent of a step goes through the model in one call
    assert torch.isnan(r.layout.main_rewards).all() != sampler.finish_main


def test_spec_cost_figure():
    # docs/algorithms.md: "10 main + 6 * sum(9 - k)" per (prompt, seed) for T = 10, B = 0..8
    assert TempFlowSampler(finish_main=True).model_evals(1) == 4 * (10 + 6 * 45)
    assert TempFlowSampler().model_evals(1) == 4 * (9 + 6 * 45)  # main stops after the last branch step
    assert TempFlowSampler().branch_steps == tuple(range(9)) and TempFlowSampler().num_completions(1) == 216


def test_rescoring_reproduces_old_log_prob(small_rollout, tiny_digits_policy):
    _, r = small_rollout
    tr, pol = r.transitions, tiny_digits_policy
    cond = pol.encode_prompts(r.prompts)
    v = pol.velocity(tr.latents, tr.sigma, index_cond(cond, tr.prompt_index))  # the trainer's recompute
    out = STEPS[r.step_type](v, tr.latents, tr.sigma, tr.sigma_next, noise_level=r.noise_level,
                             prev_sample=tr.next_latents)
    assert torch.allclose(out.log_prob, tr.old_log_prob, atol=1e-4)
    assert torch.allclose(torch.exp(out.log_prob - tr.old_log_prob), torch.ones(len(tr)), atol=1e-4)


def test_transition_weights(small_rollout, tiny_digits_policy):
    sampler, r = small_rollout
    w = noise_aware_weights(r.sigmas, sampler.noise_level, sampler.branch_steps)  # [T]
    assert torch.allclose(r.transitions.weight, w[r.transitions.step])
    assert abs(r.transitions.weight.mean().item() - 1) < 1e-5  # every branch step equally represented
    off = TempFlowSampler(**SMALL, noise_aware=False)(tiny_digits_policy, PROMPTS[:1], mean_reward)
    assert torch.equal(off.transitions.weight, torch.ones(len(off.transitions)))


# --- advantages ----------------------------------------------------------------------------
@pytest.mark.parametrize("group_by, size", [("seed", 3), ("prompt", 6)])
def test_grouping(small_rollout, group_by, size):
    _, r = small_rollout
    tr, ex = r.transitions, r.layout
    adv, info = tempflow_structure(r, group_by=group_by)
    assert adv.dtype == torch.float32 and adv.shape == (len(tr),) and not info["zero_var"].any()
    key = ex.trajectory if group_by == "seed" else tr.prompt_index
    groups = {}
    for m in range(len(tr)):
        groups.setdefault((int(key[m]), int(tr.step[m])), []).append(m)
    assert info["num_groups"] == len(groups) == {"seed": 12, "prompt": 6}[group_by]
    for (row, k), members in groups.items():
        idx = torch.tensor(members)
        assert len(members) == size and (tr.step[idx] == k).all()
        assert len(set(tr.prompt_index[idx].tolist())) == 1
        if group_by == "seed":
            assert len(set(ex.seed_slot[idx].tolist())) == 1 and len(set(r.seeds[idx].tolist())) == 1
            assert (tr.latents[idx] == tr.latents[idx[0]]).all()  # E children of one ODE latent x_k
        else:
            assert set(ex.seed_slot[idx].tolist()) == {0, 1}
        rw = r.rewards[tr.sample_index[idx]]
        expect = (rw - rw.mean()) / (rw.std(unbiased=False) + 1e-4)
        assert torch.allclose(adv[idx], expect, atol=1e-5)
    # the sampler's group_index is the default grouping; the registry resolves "tempflow" lazily
    a_default, _ = transition_advantages(r, iteration=3, unknown_option=1)
    assert torch.equal(a_default, tempflow_structure(r, group_by="seed")[0])
    assert torch.unique(r.group_index).numel() == 12


def test_zero_variance_groups(tiny_digits_policy):
    r = TempFlowSampler(**SMALL)(tiny_digits_policy, PROMPTS[:1], lambda im, p, **_: torch.ones(len(im)))
    adv, info = tempflow_structure(r)
    assert info["zero_var"].all() and (adv == 0).all() and info["zero_var_fraction"] == 1.0


# --- reproducibility -----------------------------------------------------------------------
def test_same_seed_same_rollout(tiny_digits_policy, small_rollout):
    sampler, r = small_rollout
    r2 = sampler(tiny_digits_policy, PROMPTS, mean_reward, seed=5)
    for a, b in [(r.x0, r2.x0), (r.rewards, r2.rewards), (r.transitions.next_latents, r2.transitions.next_latents),
                 (r.transitions.old_log_prob, r2.transitions.old_log_prob), (r.seeds, r2.seeds)]:
        assert torch.equal(a, b)
    assert not torch.equal(sampler(tiny_digits_policy, PROMPTS, mean_reward, seed=6).x0, r.x0)


def test_child_noise_depends_on_seed_step_branch_only(tiny_digits_policy):
    """Child (seed, k, b) is the same whatever the batch-mates, branch count or branch list."""
    pol = tiny_digits_policy
    big = TempFlowSampler(num_steps=4, branches=3, seeds_per_prompt=2)(pol, PROMPTS[:1], seeds=[11, 22])
    small = TempFlowSampler(num_steps=4, branch_steps=[1], branches=2, seeds_per_prompt=1)(pol, PROMPTS[:1], seeds=[22])
    for m in range(len(small.transitions)):
        k, b = int(small.layout.step[m]), int(small.layout.branch[m])
        sel = (big.seeds == 22) & (big.layout.step == k) & (big.layout.branch == b)
        j = int(sel.nonzero()[0])
        assert torch.allclose(small.transitions.next_latents[m], big.transitions.next_latents[j], atol=1e-5)
        assert torch.allclose(small.transitions.old_log_prob[m], big.transitions.old_log_prob[j], atol=1e-5)


# --- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(branches=1), "needs >= 2"), (dict(group_by="branch"), "group_by"), (dict(branch_steps=[]), "empty"),
    (dict(branch_steps=[2, 2]), "duplicates"), (dict(branch_steps=[10]), "outside"),
    (dict(branch_steps=[1.5]), "branch_steps must be a list, each item an integer >= 0"), (dict(noise_level=0.0), "noise_level"),
    (dict(seeds_per_prompt=0), "seeds_per_prompt"), (dict(num_steps=1), "branch_steps=\\[0\\]"),
    (dict(max_batch=0), "max_batch"), (dict(num_steps=0), "num_steps"),
])
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        TempFlowSampler(**kw)


def test_prompt_grouping_allows_single_branch():
    assert TempFlowSampler(branches=1, seeds_per_prompt=2, group_by="prompt").branches == 1


def test_bad_call_raises(tiny_digits_policy):
    sampler = TempFlowSampler(**SMALL)
    with pytest.raises(ValueError, match="prompts is empty"):
        sampler(tiny_digits_policy, [])
    with pytest.raises(ValueError, match="3 seeds"):
        sampler(tiny_digits_policy, PROMPTS, seeds=[1, 2, 3])
    flat = GroupSampler(group_size=2, num_steps=2)(tiny_digits_policy, PROMPTS[:1], mean_reward)
    with pytest.raises(ValueError, match="not a TempFlowSampler rollout"):
        tempflow_structure(flat)
    r = sampler(tiny_digits_policy, PROMPTS[:1], mean_reward)
    with pytest.raises(ValueError, match="group_by"):
        tempflow_structure(r, group_by="branch")
