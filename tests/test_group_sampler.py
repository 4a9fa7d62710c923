import pytest
import torch

from flowrl.rollout import GroupSampler
from flowrl.sde import get_step
from flowrl.types import index_cond


def brightness(images, prompts):
    return images.mean(dim=(1, 2, 3))


def test_evaluations_per_prompt(tiny_digits_policy, counting):
    pol = counting(tiny_digits_policy)
    s = GroupSampler(group_size=3, num_steps=5)
    r = s(pol, ["a handwritten digit 1", "a handwritten digit 2"], brightness, seed=0)
    assert pol.rows == 2 * 3 * 5 and pol.calls == 5  # one batched call per step
    assert r.stats["model_evals"] == 30
    assert len(r.transitions) == 30 and r.x0.shape == (6, 1, 16, 16) and r.images.shape == (6, 3, 16, 16)
    assert r.rewards.shape == (6,) and r.rewards.dtype == torch.float32


def test_same_seed_same_rollout_and_batch_invariance(tiny_digits_policy):
    s = GroupSampler(group_size=2, num_steps=3)
    a = s(tiny_digits_policy, ["a handwritten digit 1", "a handwritten digit 2"], brightness, seed=5)
    b = s(tiny_digits_policy, ["a handwritten digit 1", "a handwritten digit 2"], brightness, seed=5)
    assert torch.equal(a.x0, b.x0) and torch.equal(a.transitions.old_log_prob, b.transitions.old_log_prob)
    c = s(tiny_digits_policy, ["a handwritten digit 1", "a handwritten digit 2"], brightness, seed=6)
    assert not torch.equal(a.x0, c.x0)
    # a sample depends on its seed only: regenerate sample 3 alone with its recorded seed
    alone = GroupSampler(group_size=2, num_steps=3)(tiny_digits_policy, ["a handwritten digit 2"], brightness,
                                                    seeds=a.seeds[2:4].tolist())
    assert torch.allclose(alone.x0, a.x0[2:4], atol=1e-5)


@pytest.mark.parametrize("step", ["sde", "dance", "cps"])
def test_stored_transitions_rescore_to_old_log_prob(tiny_digits_policy, step):
    s = GroupSampler(group_size=2, num_steps=4, step=step)
    r = s(tiny_digits_policy, ["a handwritten digit 3"], brightness, seed=1)
    tr = r.transitions
    cond = index_cond(tiny_digits_policy.encode_prompts(r.prompts), tr.prompt_index)
    with torch.no_grad():
        v = tiny_digits_policy.velocity(tr.latents, tr.sigma, cond)
    out = get_step(r.step_type)(v, tr.latents, tr.sigma, tr.sigma_next, noise_level=r.noise_level,
                                prev_sample=tr.next_latents)
    stochastic = tr.sigma_next > 0 if step == "cps" else torch.ones(len(tr), dtype=torch.bool)
    assert torch.allclose(out.log_prob, tr.old_log_prob, atol=1e-4)
    assert torch.all(tr.old_log_prob[stochastic] != 0)


def test_sde_window_stores_only_window(tiny_digits_policy, counting):
    pol = counting(tiny_digits_policy)
    s = GroupSampler(group_size=2, num_steps=6, sde_window=2, window_start=1, window_shift_every=3)
    r = s(pol, ["a handwritten digit 4"], brightness, seed=0, iteration=0)
    assert sorted(set(r.transitions.step.tolist())) == [1, 2]
    assert pol.rows == 2 * 6
    assert s.sde_steps(iteration=3) == [2, 3] and s.sde_steps(iteration=14) == [0, 1]  # (1 + 14 // 3) % 5


def test_timestep_fraction():
    s = GroupSampler(group_size=2, num_steps=10, timestep_fraction=0.99)
    assert s.trained_steps() == list(range(9))


@pytest.mark.parametrize("kwargs,match", [
    (dict(group_size=1), "group_size must be an integer >= 2"),
    (dict(step="euler"), "unknown step type"),
    (dict(step="ode"), "needs a stochastic step"),
    (dict(num_steps=0), "num_steps must be an integer >= 1"),
    (dict(sde_window=11, num_steps=10), "sde_window"),
    (dict(timestep_fraction=0), "timestep_fraction"),
    (dict(noise_level=-1.0), "noise_level"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupSampler(**kwargs)


def test_reward_with_wrong_shape_is_named(tiny_digits_policy):
    with pytest.raises(ValueError, match=r"returned shape \(1,\) for 2 images"):
        GroupSampler(group_size=2, num_steps=1)(tiny_digits_policy, ["x"], lambda im, p: torch.zeros(1))
