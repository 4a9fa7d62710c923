"""Peer-compatible settings reproduce the peers' formulas (hand-transcribed here, never their code).

Flow-GRPO's KL and CPS log-prob, DanceGRPO's group normalisation, the advantage clip above 5,
and Flow-GRPO's detached unconditional half of the CFG velocity in training.
"""
import math

import pytest
import torch

from flowrl.advantages import group_advantages
from flowrl.advantages.group import group_structure
from flowrl.losses import kl_form_for_step, kl_to_reference
from flowrl.sde import cps_flow_grpo_step, cps_step, sde_step
from flowrl.trainers.config import TrainConfig
from flowrl.errors import ConfigError

torch.manual_seed(0)
X = torch.randn(3, 4, 5, 5)
V = torch.randn(3, 4, 5, 5)
V_REF = V + 0.1 * torch.randn(3, 4, 5, 5)
SIGMA = torch.tensor([1.0, 0.7, 0.3])
SIGMA_NEXT = torch.tensor([0.9, 0.5, 0.1])


def flow_grpo_std_dev_t(sigma, sigma_next, a):
    """Flow-GRPO's SDE noise coefficient: a sqrt(sigma / (1 - sigma')), sigma' = sigmas[1] at sigma = 1."""
    out = []
    for s, sn in zip(sigma.tolist(), sigma_next.tolist()):
        out.append(a * math.sqrt(s / (1 - (sn if s == 1 else s))))
    return torch.tensor(out)


def test_kl_flow_grpo_form_is_flow_grpos_formula():
    out = sde_step(V, X, SIGMA, SIGMA_NEXT, noise_level=0.7)
    ref = sde_step(V_REF, X, SIGMA, SIGMA_NEXT, noise_level=0.7, prev_sample=out.sample)
    dt = SIGMA_NEXT - SIGMA
    got = kl_to_reference(out.mean, ref.mean, out.std, dt=dt, form="flow_grpo")
    std_dev_t = flow_grpo_std_dev_t(SIGMA, SIGMA_NEXT, 0.7)
    want = [((out.mean[i] - ref.mean[i]) ** 2).mean() / (2 * std_dev_t[i] ** 2) for i in range(3)]
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=0)
    exact = kl_to_reference(out.mean, ref.mean, out.std, form="exact")
    want_exact = [((out.mean[i] - ref.mean[i]) ** 2).mean() / (2 * (std_dev_t[i] * math.sqrt(-dt[i])) ** 2)
                  for i in range(3)]
    torch.testing.assert_close(exact, torch.stack(want_exact), rtol=1e-5, atol=0)
    torch.testing.assert_close(exact * dt.abs(), got, rtol=1e-5, atol=0)  # exact = flow_grpo / |dt|


def test_kl_forms_reject_bad_input():
    m = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs dt"):
        kl_to_reference(m, m, torch.ones(2))
    with pytest.raises(ValueError, match="choose one of"):
        kl_to_reference(m, m, torch.ones(2), form="nope")
    with pytest.raises(ConfigError, match="kl_form"):
        TrainConfig(kl_form="nope")
    assert TrainConfig().kl_form == "flow_grpo"  # published betas carry over by default
    # deterministic rows (std 0) contribute 0, in both forms
    z = kl_to_reference(m, m + 1, torch.tensor([0.0, 1.0]), dt=torch.tensor([-0.1, -0.1]))
    assert z[0] == 0 and z[1] > 0


def test_cps_kl_is_exact_in_flow_grpo_form():
    # Flow-GRPO's CPS std_dev_t is the step's scale itself: its KL there is the exact one
    assert kl_form_for_step("flow_grpo", "cps") == "exact" == kl_form_for_step("flow_grpo", "cps_flow_grpo")
    assert kl_form_for_step("flow_grpo", "sde") == "flow_grpo" and kl_form_for_step("exact", "sde") == "exact"


def test_cps_flow_grpo_log_prob_is_minus_mean_square():
    eps = torch.randn_like(X)
    sn = torch.tensor([0.9, 0.5, 0.0])  # the last row is deterministic
    a = cps_step(V, X, SIGMA, sn, noise=eps)
    b = cps_flow_grpo_step(V, X, SIGMA, sn, noise=eps)
    assert torch.equal(a.sample, b.sample) and torch.equal(a.mean, b.mean) and torch.equal(a.std, b.std)
    want = [-((b.sample[i] - b.mean[i]) ** 2).mean() for i in range(2)] + [torch.tensor(0.0)]
    torch.testing.assert_close(b.log_prob, torch.stack(want))
    # scoring another policy's mean: log-ratios differ from the Gaussian ones by 2 std^2
    a2 = cps_step(V_REF, X, SIGMA, sn, prev_sample=a.sample)
    b2 = cps_flow_grpo_step(V_REF, X, SIGMA, sn, prev_sample=a.sample)
    s2 = 2 * a.std[:2] ** 2
    torch.testing.assert_close((b2.log_prob - b.log_prob)[:2], s2 * (a2.log_prob - a.log_prob)[:2], rtol=1e-3, atol=1e-6)


def test_dance_grpo_normalisation():
    r = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.2, 0.8, 0.3])
    g = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    a, _ = group_advantages(r, g, unbiased=True, eps=1e-8)
    for gid in (0, 1):
        vals = [x for x, k in zip(r.tolist(), g.tolist()) if k == gid]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - 1))  # torch's default, Bessel
        want = [(x - mean) / (std + 1e-8) for x in vals]
        torch.testing.assert_close(a[g == gid], torch.tensor(want))
    flow, _ = group_advantages(r, g)  # Flow-GRPO: population std + 1e-4
    n = 3
    assert not torch.allclose(flow[:3], a[:3]) and torch.allclose(flow[:3] * math.sqrt((n - 1) / n), a[:3], rtol=1e-3)


class _Rollout:
    def __init__(self, rewards, groups):
        self.rewards, self.group_index, self.reward_components = rewards, groups, {}
        self.transitions = type("T", (), {"sample_index": torch.arange(len(rewards))})()


def test_group_structure_names_normalisation_and_honours_clip_above_5():
    # 1 outlier among 49 equal rewards: its advantage is sqrt(48) ~ 6.9 > 5
    r = torch.zeros(50)
    r[0] = 1.0
    ro = _Rollout(r, torch.zeros(50, dtype=torch.long))
    a5, _ = group_structure(ro)
    a10, _ = group_structure(ro, adv_clip=10.0)
    assert a5[0] == 5.0  # the default clip reached
    assert 6.5 < a10[0] < 7.0  # train.adv_clip_max=10 is no longer cut at a hidden 5
    ad, _ = group_structure(ro, normalisation="dance_grpo", adv_clip=10.0)
    assert ad[0] < a10[0]  # unbiased std is larger
    with pytest.raises(ValueError, match="dance_grpo"):
        group_structure(ro, normalisation="nope")


def _grads(policy, fn):
    policy.transformer.zero_grad(set_to_none=True)
    fn().pow(2).sum().backward()
    return torch.cat([p.grad.flatten() for p in policy.transformer.parameters() if p.grad is not None])


def test_cfg_training_gradient_detaches_the_unconditional_half(tmp_path):
    """Flow-GRPO's training forward: v = u.detach() + s (c - u.detach()); values unchanged."""
    from flowrl.pipelines.sd3 import SD3Policy
    from flowrl.pipelines.tiny import make_tiny

    pol = SD3Policy.from_pretrained(make_tiny("sd3", tmp_path / "sd3"), max_sequence_length=8, guidance_scale=4.5)
    pol.transformer.requires_grad_(True)
    x = torch.randn(2, *pol.latent_shape)
    sig = torch.tensor([0.8, 0.4])
    cond = pol.encode_prompts(["a cat", "a dog"])

    def by_hand():
        out = pol._forward(torch.cat([x, x]), torch.cat([sig, sig]),
                           torch.cat([cond["negative_prompt_embeds"], cond["prompt_embeds"]]),
                           torch.cat([cond["negative_pooled_prompt_embeds"], cond["pooled_prompt_embeds"]]))
        u, c = out.float().chunk(2)
        u = u.detach()
        return u + 4.5 * (c - u)

    assert pol.cfg_uncond_grad  # a policy's default: gradient through both halves
    g_full = _grads(pol, lambda: pol.velocity(x, sig, cond))
    pol.cfg_uncond_grad = False  # what the trainer sets from train.cfg_uncond_grad=false (the default)
    v_det = pol.velocity(x, sig, cond)
    g_det = _grads(pol, lambda: pol.velocity(x, sig, cond))
    g_hand = _grads(pol, by_hand)
    pol.cfg_uncond_grad = True
    torch.testing.assert_close(v_det, pol.velocity(x, sig, cond))
    # the detached half runs as its own no-grad pass (batch B, not 2B): equal up to float32 rounding
    # of the other batch size (~4e-7 of the norm here; doubled vs float64: the same ~4e-7)
    assert (g_det - g_hand).norm() <= 1e-5 * g_hand.norm()
    assert (g_full - g_det).norm() > 1e-3 * g_det.norm()  # the setting changes the gradient


def test_trainer_passes_kl_form_dt_and_cfg_setting(tiny_digits_dir, tmp_path, monkeypatch):
    from conftest import tiny_train_overrides

    import flowrl.updates.grpo as grpo  # the GRPO update calls the loss and the KL
    import flowrl.trainers.online as online
    from flowrl.pipelines import common
    from flowrl.trainers.config import load_config

    seen, uncond = [], []
    real_kl = grpo.kl_to_reference
    monkeypatch.setattr(grpo, "kl_to_reference",
                        lambda *a, **k: seen.append((k["form"], k["dt"])) or real_kl(*a, **k))
    real_cfg = common.cfg_combine

    def spy(u, c, s, *, uncond_grad):
        uncond.append((uncond_grad, torch.is_grad_enabled()))
        return real_cfg(u, c, s, uncond_grad=uncond_grad)

    monkeypatch.setattr("flowrl.pipelines.digits.cfg_combine", spy)
    cfg = load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{
        "train.iterations": 1, "train.beta_kl": 0.04, "train.kl_form": "flow_grpo", "model.guidance_scale": 2.0}))
    online.train(cfg, tmp_path / "run")
    assert seen and all(f == "flow_grpo" and (dt < 0).all() for f, dt in seen)
    assert (False, True) in uncond  # the update's differentiable forwards detach the unconditional half
    assert all(not grad_flows for grad_flows, _ in uncond)  # train.cfg_uncond_grad=false reaches every call
