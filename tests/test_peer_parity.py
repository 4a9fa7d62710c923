"""Peer-compatible settings reproduce the peers' formulas (hand-transcribed here, never their code).

Flow-GRPO's KL and CPS log-prob, DanceGRPO's group normalisation, the advantage clip above 5,
Flow-GRPO's detached unconditional half of the CFG velocity in training, and where flowrl's Sol-RL
seed selection differs from the peer's (ties, NaN rewards; docs/parity.md).
"""
import math

import pytest
import torch

from flowrl.advantages import group_advantages
from flowrl.advantages.group import group_structure
from flowrl.losses import kl_form_for_step, kl_to_reference
from flowrl.rollout.sol import select_indices
from flowrl.sde import cps_flow_grpo_step, cps_step, sde_step
from flowrl.trainers.config import load_config
from flowrl.updates.grpo import GRPOOptions
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
    with pytest.raises(ConfigError, match="train.loss_options.kl_form must be one of"):
        load_config("digits", ["train.loss_options.kl_form=nope"])
    assert GRPOOptions().kl_form == "flow_grpo"  # published betas carry over by default
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


# ---------------------------------------------------------------- Sol-RL's seed selection
def sol_rl_best_worst(rewards: torch.Tensor, keep: int) -> torch.Tensor:
    """Sol-RL's ``best_worst`` selection (``select_indices_by_mode``, NVlabs Sana
    ``train_scripts/train_utils.py``) from its formula: the ``keep // 2`` largest rewards, and chosen
    separately the ``keep - keep // 2`` smallest, each by ``torch.topk`` (which ranks NaN above every
    number); the two lists are concatenated as they are, nothing keeps them apart."""
    n_best = keep // 2
    largest = torch.topk(rewards, n_best, largest=True).indices
    smallest = torch.topk(rewards, keep - n_best, largest=False).indices
    return torch.cat([largest, smallest])


@pytest.mark.parametrize("keep", [2, 3, 24])
def test_sol_best_worst_equals_the_peer_on_distinct_finite_rewards(keep):
    r = torch.randperm(96, generator=torch.Generator().manual_seed(keep)).float() / 96  # [96], no ties
    ours = select_indices(r, keep, "best_worst")
    peer = sol_rl_best_worst(r, keep)
    assert sorted(peer.tolist()) == ours.tolist() and len(set(peer.tolist())) == keep


def test_sol_best_worst_with_ties_the_peer_trains_a_sample_twice_flowrl_never():
    """Tied rewards (a saturated or a binary reward): the peer's largest and smallest lists may share
    samples, so one seed is regenerated and trained twice and fewer distinct samples are kept (as
    torch.topk breaks ties on the CPU, torch 2.x); flowrl ranks once (stable sort, best first) and
    takes the two ends of that one order, so its picks are always distinct."""
    pool = torch.ones(96)  # every exploration reward equal (the paper's pool 96, keep 24)
    peer = sol_rl_best_worst(pool, 24).tolist()
    assert len(set(peer)) == 12 and all(peer.count(i) == 2 for i in set(peer))  # 12 samples, each twice
    assert select_indices(pool, 24, "best_worst").tolist() == list(range(12)) + list(range(84, 96))
    binary = torch.zeros(96)
    binary[[5, 40, 77]] = 1.0  # 3 successes of a 0/1 reward
    peer = sol_rl_best_worst(binary, 24).tolist()
    ours = select_indices(binary, 24, "best_worst").tolist()
    assert {5, 40, 77} <= set(peer) and len(set(peer)) < 24  # a zero-reward seed picked twice
    assert {5, 40, 77} <= set(ours) and len(set(ours)) == 24
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # any tie pattern: flowrl's picks are distinct and hold the best and the worst reward
        r = torch.randint(0, 3, (12,), generator=g).float()
        keep = int(torch.randint(2, 13, (1,), generator=g))
        ours = select_indices(r, keep, "best_worst")
        assert len(set(ours.tolist())) == keep and r[ours].max() == r.max() and r[ours].min() == r.min()


def test_sol_selection_of_a_nan_reward_peer_best_flowrl_below_every_finite_one():
    """A NaN exploration reward (a failed reward call, or "not applicable"): torch.topk ranks it above
    every number, so the peer regenerates it as a *best* sample; flowrl ranks it below every finite
    reward (best_worst takes it as a worst one; mean_deviation, which has no order to place it in,
    takes it first) and keeps the finite best."""
    r = torch.tensor([0.2, float("nan"), 0.9, 0.1])
    assert sol_rl_best_worst(r, 2).tolist() == [1, 3]  # NaN as the best, 0.1 the worst
    assert select_indices(r, 2, "best_worst").tolist() == [1, 2]  # 0.9 the best, NaN the worst
    assert select_indices(r, 3, "best_worst").tolist() == [1, 2, 3]  # the worst two: NaN, then 0.1
    # mean_deviation: the peer's |r - mean(r)| is NaN for every sample (no ranking at all)
    assert torch.isnan((r - r.mean()).abs()).all()
    assert select_indices(r, 2, "mean_deviation").tolist() == [1, 2]  # NaN, then |0.9 - 0.4|


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
    pol.cfg_uncond_grad = False  # what the trainer sets from cfg_uncond_grad=false (the default)
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

    monkeypatch.setattr("flowrl.pipelines.pixel_flow.cfg_combine", spy)  # (the digits policy's velocity)
    cfg = load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{
        "train.iterations": 1, "train.loss_options.beta_kl": 0.04, "train.loss_options.kl_form": "flow_grpo",
        "model.guidance_scale": 2.0}))
    online.train(cfg, tmp_path / "run")
    assert seen and all(f == "flow_grpo" and (dt < 0).all() for f, dt in seen)
    assert (False, True) in uncond  # the update's differentiable forwards detach the unconditional half
    assert all(not grad_flows for grad_flows, _ in uncond)  # cfg_uncond_grad=false reaches every call
