"""One contract battery for every registered sampler (``flowrl.registry.SAMPLERS``), like
tests/test_policy_contract.py for models, on the tiny random-init digits policy:

- on-policy, the GRPO update recomputes every stored transition's log-prob (its own minibatch path:
  the rollout's conditioning, ``Transitions.select``, the step function) to the stored old one, so
  the first minibatch's PPO ratio is 1 (and the KL to an identical reference is 0);
- the same seeds give the same rollout, other seeds another;
- a prompt's samples do not depend on the other prompts of the call (alone, or in another order);
- the rollout's structure is consistent: shapes, indices into existing samples and prompts, sigmas of
  the schedule, weights, and the advantage function of its structure accepts it.

A sampler registered later fails here until it has entries in ``CASES`` (small configurations) and
``SEEDS_PER_PROMPT`` (how many seeds its ``seeds=`` override takes per prompt).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages import ADVANTAGES, transition_advantages
from flowrl.registry import SAMPLERS
from flowrl.seeding import derive_seeds
from flowrl.updates import UPDATES
from flowrl.updates.base import UpdateContext
from flowrl.updates.grpo import GRPOOptions

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]

# sampler name -> {case id: constructor options}: every step type, the window, the trees, Sol's
# backends and regenerations; each case runs in seconds on the 1-layer digits model
CASES: dict[str, dict[str, dict]] = {
    "group": {"sde": dict(group_size=3, num_steps=4, step="sde"),
              "sde_wan": dict(group_size=3, num_steps=4, step="sde_wan", noise_level=0.98),
              "dance": dict(group_size=3, num_steps=4, step="dance"),
              "cps": dict(group_size=3, num_steps=4, step="cps"),
              "sde_window": dict(group_size=3, num_steps=5, sde_window=2, window_start=1),
              "flash": dict(group_size=2, num_steps=6, sde_window=2, ode_solver="dpmpp_2m", post_window_steps=2),
              "fraction": dict(group_size=2, num_steps=4, timestep_fraction=0.5)},
    "branch": {"sde": dict(num_steps=4, split_steps=(0, 2), branch_factor=2, step="sde"),
               "dance_mix": dict(num_steps=5, split_steps=(0, 2), branch_factor=2, mode="mix", window=1)},
    "tempflow": {"seed": dict(num_steps=4, branches=2, seeds_per_prompt=2),
                 "finish_main": dict(num_steps=3, branch_steps=[0, 1], branches=3, seeds_per_prompt=1,
                                     finish_main=True, noise_aware=False)},
    "sol": {"none_group": dict(explore_backend="none", pool_size=4, keep=2, preview_steps=2, regen="group",
                               regen_options={"num_steps": 3}),
            "int8_group": dict(explore_backend="int8-dynamic", pool_size=4, keep=2, preview_steps=2, regen="group",
                               regen_options={"num_steps": 3, "step": "dance"}),
            "none_ode": dict(explore_backend="none", pool_size=3, keep=2, preview_steps=2, regen="ode",
                             regen_options={"num_steps": 3})},
    "ode": {"default": dict(group_size=2, num_steps=3)},
}

# sampler name -> seeds its ``seeds=`` override takes per prompt (prompt-major in every sampler)
SEEDS_PER_PROMPT = {"group": lambda s: s.group_size, "ode": lambda s: s.group_size, "branch": lambda s: 1,
                    "tempflow": lambda s: s.seeds_per_prompt, "sol": lambda s: s.pool_size}

PARAMS = [pytest.param(name, case, id=f"{name}-{case}") for name in SAMPLERS.names() for case in CASES.get(name, {})]


class Brightness:
    """Mean pixel value: deterministic, per image, no model to load."""

    name = "brightness"

    def __call__(self, images, prompts, **meta):
        return images.float().mean(dim=(1, 2, 3))  # [B]


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_every_registered_sampler_has_battery_entries(name):
    assert CASES.get(name), (f"sampler {name!r} is registered but has no small configuration in CASES "
                             f"(tests/test_sampler_contract.py): add one per mode it has")
    assert name in SEEDS_PER_PROMPT, f"add how many seeds per prompt sampler {name!r} takes to SEEDS_PER_PROMPT"


def make(name: str, case: str):
    return SAMPLERS.get(name)(**CASES[name][case])


def seeds_for(name, sampler, n_prompts: int, seed: int) -> list[int]:
    return derive_seeds(seed, n_prompts * SEEDS_PER_PROMPT[name](sampler))


def update_context(policy) -> UpdateContext:
    """The GRPO update's view of a one-process CPU trainer whose reference is the policy itself."""
    return UpdateContext(policy=policy, unwrapped=policy.transformer, device=torch.device("cpu"),
                         autocast=contextlib.nullcontext, reference=contextlib.nullcontext, gather=lambda t: t,
                         train=SimpleNamespace(seed=0))


@pytest.mark.parametrize("name,case", PARAMS)
def test_first_minibatch_ratio_is_one_on_policy(tiny_digits_policy, name, case):
    sampler = make(name, case)
    r = sampler(tiny_digits_policy, PROMPTS, Brightness(), seed=4)
    m = len(r.transitions)
    if not sampler.stores_transitions:
        assert m == 0  # nothing for GRPO to train on (DiffusionNFT / preference updates train on samples)
        return
    assert m > 0
    upd = UPDATES.get("grpo")(update_context(tiny_digits_policy), GRPOOptions(clip_range=1e-4, beta_kl=0.04,
                                                                               kl_form="exact"))
    adv, _ = transition_advantages(r)
    cond = r.conditioning(tiny_digits_policy)
    order = torch.randperm(m, generator=torch.Generator().manual_seed(0))  # minibatches unlike the sampling batches
    for rows in order.split(5):
        _, stats = upd.minibatch_loss(r, cond, rows, adv)
        # approx_kl = mean((logp - logp_old)^2) / 2: below 1e-10, every |log-ratio| is below 1.5e-5
        assert float(stats["approx_kl"]) < 1e-10, (rows.tolist(), float(stats["approx_kl"]))
        assert abs(float(stats["ratio_mean"]) - 1) < 1e-5 and float(stats["clip_fraction"]) == 0.0
        assert float(stats["kl"]) == 0.0  # the reference is the policy itself


@pytest.mark.parametrize("name,case", PARAMS)
def test_same_seeds_same_rollout(tiny_digits_policy, name, case):
    sampler = make(name, case)
    a = sampler(tiny_digits_policy, PROMPTS, Brightness(), seed=4)
    b = sampler(tiny_digits_policy, PROMPTS, Brightness(), seed=4)
    for field in ("x0", "images", "rewards", "seeds", "prompt_index", "group_index"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    for field in ("latents", "next_latents", "old_log_prob", "weight", "step", "sample_index"):
        assert torch.equal(getattr(a.transitions, field), getattr(b.transitions, field)), field
    explicit = sampler(tiny_digits_policy, PROMPTS, Brightness(), seed=99, seeds=seeds_for(name, sampler, 2, 4))
    assert torch.equal(explicit.x0, a.x0)  # seeds= overrides the ones derived from seed
    other = sampler(tiny_digits_policy, PROMPTS, Brightness(), seed=5)
    assert not torch.allclose(other.x0, a.x0)


def rows_of(r, prompt: int) -> dict[str, torch.Tensor]:
    """Prompt ``prompt``'s samples and transitions, in the rollout's order."""
    s = r.prompt_index == prompt
    t = r.transitions.prompt_index == prompt
    return {"x0": r.x0[s], "images": r.images[s], "rewards": r.rewards[s], "seeds": r.seeds[s],
            "latents": r.transitions.latents[t], "next_latents": r.transitions.next_latents[t],
            "old_log_prob": r.transitions.old_log_prob[t], "weight": r.transitions.weight[t],
            "step": r.transitions.step[t]}


@pytest.mark.parametrize("name,case", PARAMS)
def test_a_prompts_samples_do_not_depend_on_the_other_prompts(tiny_digits_policy, name, case):
    sampler = make(name, case)
    k = SEEDS_PER_PROMPT[name](sampler)
    seeds = seeds_for(name, sampler, 3, 7)
    prompts = PROMPTS + ["a handwritten digit 0"]
    full = sampler(tiny_digits_policy, prompts, Brightness(), seed=1, seeds=seeds)
    alone = sampler(tiny_digits_policy, prompts[1:2], Brightness(), seed=1, seeds=seeds[k:2 * k])
    swapped = sampler(tiny_digits_policy, [prompts[2], prompts[1]], Brightness(), seed=1,
                      seeds=seeds[2 * k:] + seeds[k:2 * k])
    want = rows_of(full, 1)
    assert want["x0"].shape[0] == sampler.samples_per_prompt
    for other, index in ((alone, 0), (swapped, 1)):
        got = rows_of(other, index)
        for field, value in want.items():
            assert got[field].shape == value.shape, field
            torch.testing.assert_close(got[field], value, rtol=1e-5, atol=1e-4, msg=lambda m: f"{field}: {m}")


@pytest.mark.parametrize("name,case", PARAMS)
def test_rollout_structure_is_consistent(tiny_digits_policy, name, case):
    sampler = make(name, case)
    r = sampler(tiny_digits_policy, PROMPTS, Brightness(), seed=2)
    p, n, tr = len(PROMPTS), r.num_samples, r.transitions
    latent = tuple(tiny_digits_policy.latent_shape)
    # samples
    assert n == p * sampler.samples_per_prompt and r.prompts == PROMPTS
    for field in ("prompt_index", "seeds", "group_index"):
        v = getattr(r, field)
        assert v.shape == (n,) and v.dtype == torch.long, field
    assert torch.equal(torch.bincount(r.prompt_index, minlength=p), torch.full((p,), sampler.samples_per_prompt))
    assert r.x0.shape == (n, *latent) and r.images.shape[:2] == (n, 3)
    assert 0 <= float(r.images.min()) and float(r.images.max()) <= 1
    assert r.rewards.shape == (n,) and r.rewards.dtype == torch.float32
    torch.testing.assert_close(r.rewards, Brightness()(r.images, None))  # each image scored, in order
    assert r.sigmas.shape == (sampler.num_steps + 1,) and float(r.sigmas[-1]) == 0.0
    if r.cond is not None:
        assert all(v.shape[0] == p for v in r.cond.values())
    assert r.stats["model_evals"] > 0
    # transitions: every field [M], indices into existing prompts, samples and schedule steps
    m = len(tr)
    assert (m > 0) == sampler.stores_transitions
    assert tr.latents.shape == tr.next_latents.shape == (m, *latent)
    for field in ("sigma", "sigma_next", "prompt_index", "sample_index", "step", "old_log_prob", "weight"):
        assert getattr(tr, field).shape == (m,), field
    assert ((tr.prompt_index >= 0) & (tr.prompt_index < p)).all()
    assert ((tr.sample_index >= -1) & (tr.sample_index < n)).all()
    own = tr.sample_index >= 0
    assert torch.equal(tr.prompt_index[own], r.prompt_index[tr.sample_index[own]])  # a transition's sample: its prompt
    assert ((tr.step >= 0) & (tr.step < sampler.num_steps)).all()
    assert torch.equal(tr.sigma, r.sigmas[tr.step]) and torch.equal(tr.sigma_next, r.sigmas[tr.step + 1])
    assert torch.isfinite(tr.old_log_prob).all() and torch.isfinite(tr.weight).all() and (tr.weight >= 0).all()
    # the structure's advantage function takes the rollout: one advantage per transition, masks [M]
    assert r.structure in ADVANTAGES
    if m:
        adv, info = transition_advantages(r)
        assert adv.shape == (m,) and torch.isfinite(adv).all()
        for mask in ("zero_var", "train_mask"):
            if mask in info:
                assert info[mask].shape == (m,) and info[mask].dtype == torch.bool, mask
