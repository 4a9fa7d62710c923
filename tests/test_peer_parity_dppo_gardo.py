"""Flow-DPPO and GARDO equal the peers' code (hand transcriptions of their formulas, never their files).

Transcribed from: UniRL (Tencent-Hunyuan/UniRL 1a7b501) ``unirl/algorithms/flowdppo.py``
(``_gaussian_kl_div``, ``_flowdppo_kl_adv_loss``, ``FlowDPPO._compute_sigma_t``) and the scale of its SDE step
(``unirl/sde/kernels.py``, ``FlowSDEStrategy.step``), equal in its loss math to verl-omni's ``FlowDPPOLoss``
(a1139ba); GARDO (tinnerhrhe/GARDO 1cc77fb) ``flow_grpo/stat_tracking.py``
(``PerPromptStatTracker.update(type='gardo')``), ``scripts/train_sd3_grpo_gardo.py`` (``RiskCompensator``,
the rank uncertainty and percentile gate, the gated KL of the GRPO loss, the reference reset) and
``scripts/train_sd3_nft_gardo.py`` (the NFT gated KL, the threshold update). docs/parity.md lists what differs.
"""
import math

import numpy as np
import pytest
import torch

from flowrl.losses import grpo_clipped_loss, kl_to_reference
from flowrl.losses.dppo import dppo_loss, transition_kl
from flowrl.losses.flow_matching import velocity_mse
from flowrl.losses.gardo import (UncertaintyGate, diversity_advantages, gardo_gate, gated_mean, nearest_neighbour_distance,
                                 nft_threshold_after_refresh, rank_uncertainty, reward_ranks, should_refresh)
from flowrl.schedules import flow_sigmas
from flowrl.sde import sde_step

RTOL = 1e-6


def close(a, b, rtol=RTOL):
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)


def close_grad(a, b, rtol=RTOL):
    assert (a - b).norm() <= rtol * b.norm(), f"relative gradient difference {((a - b).norm() / b.norm()).item():.2e}"


# ---------------------------------------------------------------- Flow-DPPO
def unirl_sigma_t(sigma, sigma_next, eta):
    """FlowDPPO._compute_sigma_t: std_dev_t * sqrt(-dt), std_dev_t = sqrt(s / (1 - min(s, 0.99))) * eta."""
    return torch.sqrt(sigma / (1.0 - torch.clamp(sigma, max=0.99))) * eta * torch.sqrt(-(sigma_next - sigma))


def unirl_dppo_loss(new_logp, old_logp, new_means, old_means, advantages, sigma_t, threshold):
    """_flowdppo_kl_adv_loss reduced by FlowDPPO.compute_loss_and_backward (mean)."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.detach()
    unclipped = -adv * ratio
    kl = ((new_means - old_means) ** 2 / (2 * sigma_t**2)).mean(dim=tuple(range(1, new_means.ndim)))
    kl_mask = kl < threshold
    rm = ((~kl_mask) & (ratio > 1.0) & (adv > 0)) | ((~kl_mask) & (ratio < 1.0) & (adv < 0))
    return torch.where((~rm).detach(), unclipped, torch.zeros(())).mean(), ~rm


def _transitions(seed=0, m=16):
    """SDE transitions on SD3.5's 10-step schedule (steps 1..8: sigma < 1, as UniRL's sampled window)."""
    g = torch.Generator().manual_seed(seed)
    sig = flow_sigmas(10, 3.0)
    step = torch.randint(1, 9, (m,), generator=g)
    s, sn = sig[step], sig[step + 1]
    x = torch.randn(m, 4, 6, 6, generator=g)
    v_old = torch.randn(m, 4, 6, 6, generator=g)
    old = sde_step(v_old, x, s, sn, noise_level=0.7, generator=g)
    v = (v_old + 0.02 * torch.randn(m, 4, 6, 6, generator=g)).requires_grad_(True)
    new = sde_step(v, x, s, sn, noise_level=0.7, prev_sample=old.sample)
    adv = torch.randn(m, generator=g)
    return v, new, old, adv, s, sn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dppo_loss_mask_and_gradient_equal_unirl(seed):
    v, new, old, adv, s, sn = _transitions(seed)
    sigma_t = unirl_sigma_t(s, sn, 0.7)
    close(sigma_t, new.std)  # UniRL's recomputed scale is the step's own scale (sigma < 1)
    kl = transition_kl(new.mean.detach(), old.mean, new.std)
    srt = kl.sort().values
    tau = float((srt[7] + srt[8]) / 2)  # half the transitions above the threshold
    ours, stats = dppo_loss(new.log_prob, old.log_prob, new.mean, old.mean, new.std, adv, kl_threshold=tau)
    (g_ours,) = torch.autograd.grad(ours, v, retain_graph=True)
    peer, keep = unirl_dppo_loss(new.log_prob, old.log_prob, new.mean, old.mean.detach(), adv,
                                 sigma_t.view(-1, 1, 1, 1), tau)
    (g_peer,) = torch.autograd.grad(peer, v)
    close(ours, peer)
    close_grad(g_ours, g_peer)
    assert stats["masked_fraction"] == (~keep).float().mean() and 0 < stats["masked_fraction"] < 0.5
    assert stats["high_kl_fraction"] == 0.5


def unirl_sampler_scale(sigma, sigma_next, sigma_max, eta):
    """The scale of UniRL's own SDE step (``FlowSDEStrategy.step``, ``unirl/sde/kernels.py``) as its SD3 rollout and
    ``replay`` call it (``sigma_max = sigmas[1]``): ``std_dev_t sqrt(-dt)``, ``std_dev_t = sqrt(s / (1 - s')) * eta``
    with ``s' = sigma_max`` where ``s == 1``, else ``s``."""
    return torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta * torch.sqrt(-(sigma_next - sigma))


def test_dppo_step_zero_scale_is_the_samplers_where_unirl_kl_clamps_at_099():
    sig = flow_sigmas(10, 3.0)  # UniRL's SD3.5-M setting: 10 steps, shift 3, noise level 0.7, SDE steps among 0-4
    s, sn = sig[:5], sig[1:6]
    ours = sde_step(torch.zeros(5, 1), torch.zeros(5, 1), s, sn, noise_level=0.7).std  # [5]
    close(ours, unirl_sampler_scale(s, sn, sig[1], 0.7))  # flowrl's scale is UniRL's sampler's, step 0 included
    peer = unirl_sigma_t(s, sn, 0.7)  # the scale UniRL's KL divides by
    close(peer[1:], ours[1:])  # below sigma 0.99 the same
    factor = (peer[0] / ours[0]) ** 2  # at step 0 (sigma 1): min(1, 0.99) against sigmas[1] = 0.960
    close(factor, (1 - sig[1]) / 0.01, rtol=1e-5)  # float32's 1 - 0.99
    assert 3.98 < factor < 3.99  # UniRL's step-0 D is 1 / 3.99 of the KL of the transition it sampled
    # a step-0 transition whose KL (under the sampler's Gaussians) is 2 tau, moving aggressively (r > 1, A > 0)
    std = ours[:1]
    old_mean = torch.zeros(1, 4, 3, 3)
    mean = old_mean + 0.01
    kl = transition_kl(mean, old_mean, std)
    tau = float(kl[0]) / 2
    lp, adv = torch.tensor([0.1], requires_grad=True), torch.tensor([1.0])
    _, stats = dppo_loss(lp, torch.zeros(1), mean, old_mean, std, adv, kl_threshold=tau)
    _, keep = unirl_dppo_loss(lp, torch.zeros(1), mean, old_mean, adv, peer[:1].view(-1, 1, 1, 1), tau)
    assert stats["masked_fraction"] == 1 and bool(keep[0])  # flowrl drops it; UniRL's KL (2 tau / 3.99) keeps it


def test_dppo_by_hand():
    m = 4
    mean = torch.zeros(m, 2, 3, 3)
    std = torch.full((m,), 0.1)
    lp = torch.tensor([0.1, 0.1, -0.1, -0.1], requires_grad=True)  # ratio > 1, > 1, < 1, < 1
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    # identical old and new transition: KL 0, nothing masked, plain -A ratio
    loss, stats = dppo_loss(lp, lp.detach(), mean, mean, std, adv)
    assert stats["kl_max"] == 0 and stats["masked_fraction"] == 0 and loss == -adv.mean()
    # every transition far from the old one: only the aggressive moves (rows 0 and 2) are dropped
    moved = mean + 0.1  # D = 0.01 / (2 * 0.01) = 0.5 per transition
    close(transition_kl(moved, mean, std), torch.full((m,), 0.5))
    close(transition_kl(moved, mean, std, normalise=False), torch.full((m,), 0.005))
    loss, stats = dppo_loss(lp, torch.zeros(m), moved, mean, std, adv, kl_threshold=0.5)  # D >= tau counts as high
    r = math.exp(0.1)
    assert stats["masked_fraction"] == 0.5 and stats["pos_rm_fraction"] == 0.25 and stats["neg_rm_fraction"] == 0.25
    close(loss, torch.tensor((-(-1.0) * r - 1.0 / r) / 4))  # rows 1 (corrective, A<0, r>1) and 3 (A>0, r<1) kept
    (g,) = torch.autograd.grad(loss, lp)
    assert g[0] == 0 and g[2] == 0 and g[1] != 0 and g[3] != 0
    loss, stats = dppo_loss(lp, torch.zeros(m), moved, mean, std, adv, kl_threshold=0.6)  # below the threshold: all kept
    assert stats["masked_fraction"] == 0
    assert dppo_loss(lp, torch.zeros(m), moved, mean, std, torch.zeros(m))[0] == 0  # zero advantages: zero loss
    with pytest.raises(ValueError, match="kl_threshold"):
        dppo_loss(lp, lp, mean, mean, std, adv, kl_threshold=0.0)


# ---------------------------------------------------------------- GARDO: diversity-aware advantages
def gardo_tracker(prompts, rewards, dists):
    """PerPromptStatTracker.update(prompts, rewards, dists, type='gardo') with rewards [N, 1], one epoch."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    dists = np.array(dists)
    dists = dists / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        pr = rewards[prompts == prompt]
        mean = np.mean(pr, axis=0, keepdims=True)
        pd = dists[prompts == prompt]
        dm = 1 - np.dot(pd, pd.T).clip(-1, 1)
        nn = np.zeros(len(dm))
        for i in range(len(dm)):
            mask = np.ones(len(dm), dtype=bool)
            mask[i] = False
            nn[i] = np.min(dm[i, mask])
        pd = np.repeat(nn[:, np.newaxis], pr.shape[-1], axis=1)
        pd = np.where((pr - mean) < 0, np.ones_like(pd), pd / np.mean(pd))
        advantages[prompts == prompt] = (pr - mean) * pd
    return advantages


@pytest.mark.parametrize("seed", [0, 1])
def test_diversity_advantages_equal_gardo(seed):
    g = torch.Generator().manual_seed(seed)
    groups, per, dim = 4, 6, 32
    group_index = torch.arange(groups).repeat_interleave(per)[torch.randperm(groups * per, generator=g)]
    rewards = torch.rand(groups * per, generator=g)
    feats = torch.randn(groups * per, dim, generator=g) + 0.5 * torch.randn(groups, dim, generator=g)[group_index]
    ours, w = diversity_advantages(rewards, feats, group_index)
    peer = gardo_tracker([f"p{i}" for i in group_index.tolist()], rewards.numpy()[:, None], feats.numpy())
    close(ours, torch.from_numpy(peer[:, 0]).float())
    above = rewards >= torch.stack([rewards[group_index == k].mean() for k in range(groups)])[group_index]
    assert (w[~above] == 1).all() and (w[above] != 1).any()


def test_diversity_advantages_by_hand():
    # a group of 3: the two above-mean samples; the far one is raised, the near duplicate lowered
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # nearest distances 1, 0, 0 -> mean 1/3
    close(nearest_neighbour_distance(feats), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    adv, w = diversity_advantages(torch.tensor([1.0, 1.0, 0.0]), feats, torch.zeros(3, dtype=torch.long))
    close(w, torch.tensor([3.0, 0.0, 1.0]))
    close(adv, torch.tensor([1.0, 0.0, -2.0 / 3.0]))  # (r - 2/3) * w: no division by a reward std
    same = diversity_advantages(torch.tensor([0.5, 0.7]), torch.ones(2, 4), torch.zeros(2, dtype=torch.long))
    close(same[1], torch.ones(2))  # identical features: weights 1 (the peer's 0/0 would be NaN)


# ---------------------------------------------------------------- GARDO: the uncertainty gate
class RiskCompensator:
    """GARDO's RiskCompensator, as written (numpy)."""

    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer, self.base, self.alpha, self.beta = [], base, 0.1, beta
        self.beta_min, self.beta_max = 0.02, 0.2

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        self.risk_buffer = self.risk_buffer[-20:]


def gardo_peer_gate(rewards: dict, main: str, controller: RiskCompensator):
    ranks = []
    for item in ["aesthetic", "imagereward", main]:
        _, indices = torch.sort(torch.tensor(rewards[item]), descending=True)
        r = torch.empty_like(torch.tensor(rewards[item])).long()
        r[indices] = torch.arange(1, len(rewards[item]) + 1)
        ranks.append(r.float())
    u = ranks[-1] - (ranks[0] + ranks[1]) / 2
    controller.update(np.array([p for p in u.cpu().numpy() if p >= 0]))
    threshold = np.percentile(np.array([p for p in u.cpu().numpy() if p >= 0]), 100 - controller.beta * 100)
    return u > threshold


def test_uncertainty_gate_equals_gardo_over_iterations():
    g = torch.Generator().manual_seed(0)
    peer_ctrl, state = RiskCompensator(), UncertaintyGate()
    fractions = set()
    for it in range(30):
        n = 48
        ocr = torch.rand(n, generator=g)
        drift = 0.02 * it  # auxiliary rewards drift from the main one: more disagreement later
        rewards = {"ocr": ocr.numpy(), "aesthetic": (ocr + (0.3 + drift) * torch.randn(n, generator=g)).numpy(),
                   "imagereward": (ocr + (0.3 + drift) * torch.randn(n, generator=g)).numpy()}
        peer = gardo_peer_gate(rewards, "ocr", peer_ctrl)
        gate, state, stats = gardo_gate(torch.from_numpy(rewards["ocr"]),
                                        [torch.from_numpy(rewards["aesthetic"]), torch.from_numpy(rewards["imagereward"])],
                                        state)
        assert torch.equal(gate, peer) and state.fraction == pytest.approx(float(peer_ctrl.beta), rel=1e-12)
        fractions.add(round(state.fraction, 6))
        assert 0 < stats["gated_share"] <= 0.2
    assert len(fractions) > 2  # the controller moved


def test_rank_uncertainty_by_hand():
    close(reward_ranks(torch.tensor([0.2, 0.9, 0.5])), torch.tensor([3.0, 1.0, 2.0]))
    main = torch.tensor([0.9, 0.1, 0.5])  # ranks 1 3 2
    aux = [torch.tensor([0.1, 0.9, 0.5]), torch.tensor([0.2, 0.8, 0.5])]  # ranks 3 1 2 each
    close(rank_uncertainty(main, aux), torch.tensor([-2.0, 2.0, 0.0]))
    st = UncertaintyGate().update(torch.tensor([1.0]))
    assert st.fraction == 0.1 and st.history == (1.0,)
    st = st.update(torch.tensor([2.0]))
    assert st.fraction == pytest.approx(0.11)
    st = st.update(torch.tensor([0.5]))
    assert st.fraction == pytest.approx(0.099)
    assert len(UncertaintyGate(history=tuple(range(20))).update(torch.tensor([3.0])).history) == 20


# ---------------------------------------------------------------- GARDO: the gated KL in GRPO and NFT
def test_gardo_grpo_loss_equals_gardo():
    """The GRPO-GARDO per-step loss: mean(policy) + beta * mean over gated rows of the Flow-GRPO KL."""
    g = torch.Generator().manual_seed(4)
    m, a, beta = 8, 0.7, 0.04
    sig = flow_sigmas(10, 3.0)
    s, sn = sig[3].expand(m), sig[4].expand(m)  # one step j for the whole batch, as the peer trains
    x = torch.randn(m, 4, 6, 6, generator=g)
    v_old = torch.randn(m, 4, 6, 6, generator=g)
    old = sde_step(v_old, x, s, sn, noise_level=a, generator=g)
    v = (v_old + 0.05 * torch.randn(m, 4, 6, 6, generator=g)).requires_grad_(True)
    v_ref = v_old + 0.05 * torch.randn(m, 4, 6, 6, generator=g)
    cur = sde_step(v, x, s, sn, noise_level=a, prev_sample=old.sample)
    ref = sde_step(v_ref, x, s, sn, noise_level=a, prev_sample=old.sample)
    adv = torch.randn(m, generator=g)
    for gate in (torch.tensor([1, 0, 0, 1, 0, 0, 0, 1], dtype=torch.bool), torch.zeros(m, dtype=torch.bool)):
        # the peer: std_dev_t is the SDE noise coefficient, without sqrt(-dt)
        std_dev_t = (torch.sqrt(s / (1 - s)) * a).view(-1, 1, 1, 1)
        ratio = torch.exp(cur.log_prob - old.log_prob)
        pol = (std_dev_t[:, 0, 0, 0] / torch.mean(std_dev_t[:, 0, 0, 0])) * torch.maximum(
            -adv * ratio, -adv * torch.clamp(ratio, 1.0 - 1e-5, 1.0 + 1e-5))
        peer = torch.mean(pol)
        if gate.any():
            peer = peer + beta * torch.mean(torch.square(cur.mean[gate] - ref.mean[gate]) / (2 * std_dev_t[gate] ** 2))
        kl = kl_to_reference(cur.mean, ref.mean.detach(), cur.std, dt=sn - s, form="flow_grpo")  # [M]
        ours = grpo_clipped_loss(cur.log_prob, old.log_prob, adv, 1e-5)[0] + beta * gated_mean(kl, gate)
        close(ours, peer)
        close_grad(torch.autograd.grad(ours, v, retain_graph=True)[0], torch.autograd.grad(peer, v, retain_graph=True)[0])


def test_gardo_nft_gated_kl_equals_gardo():
    g = torch.Generator().manual_seed(5)
    v = torch.randn(6, 4, 5, 5, generator=g).requires_grad_(True)
    v_ref = v.detach() + 0.1 * torch.randn(6, 4, 5, 5, generator=g)
    for gate in (torch.tensor([0, 1, 1, 0, 0, 0], dtype=torch.bool), torch.zeros(6, dtype=torch.bool)):
        if gate.any():  # the NFT script: the gated rows, or every row when none is gated
            peer = ((v[gate] - v_ref[gate]) ** 2).mean(dim=(1, 2, 3)).mean()
        else:
            peer = ((v - v_ref) ** 2).mean(dim=(1, 2, 3)).mean()
        ours = gated_mean(velocity_mse(v, v_ref), gate, when_empty="all")
        close(ours, peer)
        close_grad(torch.autograd.grad(ours, v)[0], torch.autograd.grad(peer, v)[0])
    assert gated_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool)) == 0  # GRPO: no gated row, no KL


# ---------------------------------------------------------------- GARDO: the reference refresh
def test_reference_refresh_schedule_equals_gardo():
    g = torch.Generator().manual_seed(6)
    exceeded = (torch.rand(80, generator=g) < 0.08).tolist()  # the KL crossed the threshold in that iteration
    peer, prev, reset = [], 0, False
    for epoch in range(80):
        if (epoch != 0 and reset) or (epoch - prev) > 15:
            peer.append(epoch)
            reset, prev = False, epoch
        if exceeded[epoch]:
            reset = True
    ours, last, flag = [], 0, False
    for it in range(80):
        if should_refresh(it, last, flag):
            ours.append(it)
            last, flag = it, False
        flag = flag or exceeded[it]
    assert ours == peer and len(ours) >= 4
    assert not should_refresh(0, 0, True) and should_refresh(16, 0, False) and not should_refresh(15, 0, False)
    assert nft_threshold_after_refresh(0.15, 16) == pytest.approx(0.14)
    assert nft_threshold_after_refresh(0.1, 30) == 0.1 and nft_threshold_after_refresh(0.14, 3) == 0.05
    assert nft_threshold_after_refresh(0.12, 10) == 0.12
