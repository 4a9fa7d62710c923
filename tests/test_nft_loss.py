"""DiffusionNFT loss (flowrl.losses.nft) against hand-computed values."""
import pytest
import torch

from flowrl.losses.nft import nft_loss


def _case():
    """Two one-element samples, beta = 1, Amax = 2 (values worked by hand in the comments)."""
    x0 = torch.tensor([1.0, -1.0]).view(2, 1, 1, 1)
    x_t = torch.tensor([0.5, 0.0]).view(2, 1, 1, 1)
    t = torch.tensor([0.5, 0.25])
    v_theta = torch.tensor([0.2, -0.4]).view(2, 1, 1, 1).requires_grad_(True)
    v_old = torch.tensor([0.0, 0.4]).view(2, 1, 1, 1)
    adv = torch.tensor([1.0, -4.0])  # r = 0.75; A clipped to -2 -> r = 0
    return v_theta, v_old, x_t, x0, t, adv


def test_hand_computed_case():
    v_theta, v_old, x_t, x0, t, adv = _case()
    loss, stats = nft_loss(v_theta, v_old, x_t, x0, t, adv, beta=1.0, adv_clip_max=2.0)
    # sample 1: v+ = 0.2, v- = -0.2; x0+ = 0.4, x0- = 0.6; L+ = 0.36 / 0.6 = 0.6, L- = 0.16 / 0.4 = 0.4
    #           r L+ + (1 - r) L- = 0.75 * 0.6 + 0.25 * 0.4 = 0.55
    # sample 2: v+ = -0.4, v- = 1.2; x0+ = 0.1, x0- = -0.3; L+ = 1.21 / 1.1 = 1.1, L- = 0.49 / 0.7 = 0.7
    #           r = 0 -> 0.7
    # L = mean(0.55, 0.7) / beta * Amax = 0.625 * 2 = 1.25
    assert loss.item() == pytest.approx(1.25, abs=1e-6)
    assert stats["positive_loss"] == pytest.approx((0.6 + 1.1) / 2, abs=1e-6)
    assert stats["negative_loss"] == pytest.approx((0.4 + 0.7) / 2, abs=1e-6)
    assert stats["r_mean"] == pytest.approx(0.375)
    loss.backward()
    # the adaptive weight is a stop-gradient: dL+/dv = 2 err+ (-t beta) / w+, dL-/dv = 2 err- (t beta) / w-
    # sample 1: 0.75 * 1.0 + 0.25 * (-1.0) = 0.5; sample 2: 0 * (...) + 1 * 2 * 0.7 * 0.25 / 0.7 = 0.5
    # times mean (1/2) and Amax / beta (2)
    assert torch.allclose(v_theta.grad.flatten(), torch.tensor([0.5, 0.5]), atol=1e-6)


def test_kl_term_and_its_gradient():
    v_theta, v_old, x_t, x0, t, adv = _case()
    v_ref = torch.zeros_like(v_old)
    loss, stats = nft_loss(v_theta, v_old, x_t, x0, t, adv, beta=1.0, adv_clip_max=2.0, v_ref=v_ref, beta_kl=0.5)
    # KL = mean(0.2^2, 0.4^2) = 0.1; total = 1.25 + 0.5 * 0.1
    assert stats["kl"] == pytest.approx(0.1, abs=1e-6)
    assert loss.item() == pytest.approx(1.3, abs=1e-6)
    loss.backward()
    # + beta_kl * 2 (v - v_ref) / B = 0.5 * [0.2, -0.4]
    assert torch.allclose(v_theta.grad.flatten(), torch.tensor([0.6, 0.3]), atol=1e-6)


def test_means_over_elements_and_floor():
    x0 = torch.tensor([1.0, -1.0]).view(1, 1, 1, 2)
    z = torch.zeros_like(x0)
    # v = v_old = 0, A = 0 (r = 0.5): x0+- = x_t = 0, err = [-1, 1], w = 1, L+- = 1 -> L = 1 * Amax
    loss, _ = nft_loss(z, z, z, x0, torch.tensor([0.5]), torch.tensor([0.0]), beta=0.3, adv_clip_max=2.0)
    assert loss.item() == pytest.approx(1.0 / 0.3 * 2.0, rel=1e-6)
    # a perfect prediction: the weight is floored at 1e-5, the loss is 0 (no NaN)
    loss, _ = nft_loss(z, z, x0, x0, torch.tensor([0.5]), torch.tensor([1.0]))
    assert loss.item() == 0.0


def test_saturated_advantages_pick_one_side():
    v_theta, v_old, x_t, x0, t, _ = _case()
    pos, s = nft_loss(v_theta, v_old, x_t, x0, t, torch.tensor([5.0, 9.0]), adv_clip_max=2.0)
    assert s["r_mean"] == 1.0 and pos.item() == pytest.approx(s["positive_loss"] * 2.0, rel=1e-6)
    neg, s = nft_loss(v_theta, v_old, x_t, x0, t, torch.tensor([-5.0, -2.0]), adv_clip_max=2.0)
    assert s["r_mean"] == 0.0 and neg.item() == pytest.approx(s["negative_loss"] * 2.0, rel=1e-6)


def test_float32_math_for_bf16_inputs():
    v_theta, v_old, x_t, x0, t, adv = _case()
    loss, _ = nft_loss(v_theta.detach().bfloat16(), v_old.bfloat16(), x_t.bfloat16(), x0.bfloat16(), t, adv,
                       adv_clip_max=2.0)
    assert loss.dtype == torch.float32


def test_errors_name_the_fix():
    v_theta, v_old, x_t, x0, t, adv = _case()
    with pytest.raises(ValueError, match="beta must be > 0"):
        nft_loss(v_theta, v_old, x_t, x0, t, adv, beta=0.0)
    with pytest.raises(ValueError, match="needs v_ref"):
        nft_loss(v_theta, v_old, x_t, x0, t, adv, beta_kl=0.1)
    with pytest.raises(ValueError, match="shape"):
        nft_loss(v_theta, v_old[:1], x_t, x0, t, adv)
    with pytest.raises(ValueError, match=r"\[2\]"):
        nft_loss(v_theta, v_old, x_t, x0, t[:1], adv)


def test_video_latents_equal_their_flattened_image_view():
    """Means run over every non-batch dim: a video batch [B, C, F, H, W] gives the loss, stats and
    gradient of the same numbers viewed as [B, C, F H, W] (no 4-D assumption in the time broadcast)."""
    g = torch.Generator().manual_seed(0)
    shape = (3, 2, 3, 4, 4)  # [B, C, F, H, W]
    x0, eps, v_old = (torch.randn(shape, generator=g) for _ in range(3))
    t = torch.rand(3, generator=g) * 0.9 + 0.05
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * eps
    adv = torch.tensor([1.0, -0.5, 0.2])
    flat = (3, 2, 12, 4)
    v5 = torch.randn(shape, generator=g).requires_grad_(True)
    v4 = v5.detach().reshape(flat).requires_grad_(True)
    l5, s5 = nft_loss(v5, v_old, x_t, x0, t, adv, v_ref=v_old, beta_kl=0.1)
    l4, s4 = nft_loss(v4, v_old.reshape(flat), x_t.reshape(flat), x0.reshape(flat), t, adv, v_ref=v_old.reshape(flat),
                      beta_kl=0.1)
    torch.testing.assert_close(l5, l4)
    assert s5 == pytest.approx(s4)
    l5.backward(), l4.backward()
    torch.testing.assert_close(v5.grad.reshape(flat), v4.grad)
