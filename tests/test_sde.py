import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowrl.schedules import flow_sigmas
from flowrl.sde import STEPS, cps_step, dance_step, get_step, ode_step, sde_step, sde_wan_step

torch.manual_seed(0)
X = torch.randn(3, 2, 4, 4)
V = torch.randn(3, 2, 4, 4)


def test_ode_equals_diffusers_step_bitwise():
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sch.set_timesteps(10)
    x = X.clone()
    ours = X.clone()
    sig = flow_sigmas(10, 3.0)
    for i, t in enumerate(sch.timesteps):
        v = torch.randn_like(x)
        x = sch.step(v, t, x, return_dict=False)[0]
        out = ode_step(v, ours, sig[i], sig[i + 1])
        ours = out.sample
        assert torch.equal(ours, x)
        assert torch.all(out.log_prob == 0) and torch.all(out.std == 0)


def _normal_logprob_mean(sample, mean, scale):
    return torch.distributions.Normal(mean, scale).log_prob(sample).mean(dim=(1, 2, 3))


def test_sde_step_hand_computed():
    s, sn, a = 0.6, 0.4, 0.7
    out = sde_step(V, X, s, sn, noise_level=a, generator=torch.Generator().manual_seed(1))
    dt = sn - s
    std_t = a * math.sqrt(s / (1 - s))
    mean = X * (1 + std_t**2 / (2 * s) * dt) + V * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    scale = std_t * math.sqrt(-dt)
    assert torch.allclose(out.mean, mean, atol=1e-6)
    assert torch.allclose(out.std, torch.full((3,), scale), atol=1e-6)
    assert torch.allclose(out.log_prob, _normal_logprob_mean(out.sample, mean, torch.tensor(scale)), atol=1e-5)


def test_sde_step_first_step_uses_next_sigma_as_sigma_max():
    out = sde_step(V, X, 1.0, 0.9, noise_level=0.7)
    std_t = 0.7 * math.sqrt(1.0 / (1 - 0.9))
    assert torch.isfinite(out.log_prob).all()
    assert torch.allclose(out.std, torch.full((3,), std_t * math.sqrt(0.1)), atol=1e-5)


def test_sde_wan_step_hand_computed():
    """Flow-GRPO's Wan step: std_t = sigma_1 * sigma (its schedule's second sigma; the last is 0), the
    sde step's mean, scale std_t sqrt(-dt), the Gaussian log-density averaged over non-batch dims; also
    at sigma = 1 (finite, no sigma_next substitution) and at the last step (sigma_next = 0, still noisy)."""
    a = 0.9828
    for s, sn in ((0.6, 0.4), (1.0, 0.9828), (0.14, 0.0)):
        out = sde_wan_step(V, X, s, sn, noise_level=a, generator=torch.Generator().manual_seed(2))
        dt = sn - s
        std_t = a * s
        mean = X * (1 + std_t**2 / (2 * s) * dt) + V * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        scale = std_t * math.sqrt(-dt)
        assert torch.allclose(out.mean, mean, atol=1e-6)
        assert torch.allclose(out.std, torch.full((3,), scale), atol=1e-6)
        lp = ((-(out.sample - mean) ** 2 / (2 * scale**2)) - math.log(scale) - 0.5 * math.log(2 * math.pi))
        assert torch.allclose(out.log_prob, lp.mean(dim=(1, 2, 3)), atol=1e-5)
        assert torch.allclose(out.log_prob, _normal_logprob_mean(out.sample, mean, torch.tensor(scale)), atol=1e-5)
    draws = torch.stack([sde_wan_step(V, X, 0.6, 0.4, noise_level=a, generator=torch.Generator().manual_seed(i)).sample
                         for i in range(400)])  # [400, 3, 2, 4, 4]
    assert torch.allclose(draws.std(0).mean(), torch.tensor(a * 0.6 * math.sqrt(0.2)), rtol=0.05)
    video = sde_wan_step(V[:, :, None].expand(3, 2, 3, 4, 4), X[:, :, None].expand(3, 2, 3, 4, 4), 0.6, 0.4)
    assert video.sample.shape == (3, 2, 3, 4, 4) and video.log_prob.shape == (3,)  # [B, C, F, h, w] latents


def test_flow_grpo_kl_of_the_wan_step_is_the_exact_form():
    """scripts/train_wan2_1.py divides the squared mean gap by 2 (std_dev_t sqrt(-dt))^2: the exact KL."""
    from flowrl.losses.grpo import kl_form_for_step

    assert kl_form_for_step("flow_grpo", "sde_wan") == "exact" and kl_form_for_step("flow_grpo", "sde") == "flow_grpo"


def test_dance_step_hand_computed():
    s, sn, eta = 0.8, 0.5, 0.3
    out = dance_step(V, X, s, sn, noise_level=eta)
    dt = sn - s
    x0 = X - s * V
    score = -(X - (1 - s) * x0) / s**2
    mean = X + dt * V + dt * (-0.5 * eta**2) * score
    scale = eta * math.sqrt(-dt)
    assert torch.allclose(out.mean, mean, atol=1e-6)
    assert torch.allclose(out.log_prob, _normal_logprob_mean(out.sample, mean, torch.tensor(scale)), atol=1e-5)


def test_cps_step_hand_computed():
    s, sn, eta = 0.8, 0.5, 0.8
    out = cps_step(V, X, s, sn, noise_level=eta)
    std = sn * math.sin(eta * math.pi / 2)
    mean = (1 - sn) * (X - s * V) + math.sqrt(sn**2 - std**2) * (X + (1 - s) * V)
    assert torch.allclose(out.mean, mean, atol=1e-6)
    assert torch.allclose(out.log_prob, _normal_logprob_mean(out.sample, mean, torch.tensor(std)), atol=1e-5)
    last = cps_step(V, X, 0.2, 0.0)  # sigma_next = 0: deterministic
    assert torch.all(last.log_prob == 0) and torch.equal(last.sample, last.mean)


@pytest.mark.parametrize("name", ["sde", "sde_wan", "dance", "cps"])
def test_rescoring_returns_same_log_prob(name):
    fn = get_step(name)
    out = fn(V, X, 0.7, 0.5)
    again = fn(V, X, 0.7, 0.5, prev_sample=out.sample)
    assert torch.allclose(again.log_prob, out.log_prob, atol=1e-6)
    assert torch.equal(again.sample, out.sample)
    other = fn(V, X, 0.7, 0.5, prev_sample=out.sample + 0.5)
    assert torch.all(other.log_prob < out.log_prob)


@pytest.mark.parametrize("name", ["sde", "sde_wan", "dance", "cps"])
def test_noise_level_zero_is_euler(name):
    out = get_step(name)(V, X, 0.7, 0.5, noise_level=0.0)
    euler = ode_step(V, X, 0.7, 0.5)
    assert torch.allclose(out.sample, euler.sample, atol=1e-6)
    assert torch.all(out.log_prob == 0)


def test_tensor_sigmas_and_dtype():
    s = torch.tensor([0.9, 0.6, 0.3])
    out = sde_step(V.bfloat16(), X.bfloat16(), s, s - 0.1)
    assert out.sample.dtype == torch.float32 and out.log_prob.shape == (3,)
    row = sde_step(V[1:2], X[1:2], 0.6, 0.5, prev_sample=out.sample[1:2].clone())
    assert torch.allclose(row.log_prob, sde_step(V.bfloat16(), X.bfloat16(), s, s - 0.1,
                                                 prev_sample=out.sample).log_prob[1:2], atol=1e-2)
    with pytest.raises(ValueError, match="sigma must be"):
        sde_step(V, X, torch.tensor([0.5, 0.4]), 0.3)


def test_unknown_step_lists_valid():
    with pytest.raises(ValueError, match="unknown step type 'ddim'.* Valid step types: cps, cps_flow_grpo, dance"):
        get_step("ddim")
    assert set(STEPS) == {"ode", "sde", "sde_wan", "dance", "cps", "cps_flow_grpo"}


def test_given_noise_is_used():
    eps = torch.randn_like(X)
    out = dance_step(V, X, 0.5, 0.3, noise=eps)
    assert torch.allclose(out.sample, out.mean + out.std.view(-1, 1, 1, 1) * eps, atol=1e-6)
