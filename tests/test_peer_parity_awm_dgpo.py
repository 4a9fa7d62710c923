"""AWM and DGPO equal the peers' code (hand transcriptions of their formulas, never their files).

Transcribed from: Flow-Factory (X-GenGroup/Flow-Factory a0b2bc5) ``utils/noise_schedule.py``
(``TimeSampler``), ``trainers/awm.py`` (``compute_weighted_log_prob``, ``optimize``) and
``trainers/dgpo.py`` (``_compute_dsm_loss``, ``_maybe_clip_dsm``, ``_compute_group_dgpo_loss``, the KL of
``_apply_total_loss_and_backward``); the group term also equals the official DGPO's
``compute_group_dgpo_loss_allreduce`` (Luo-Yihong/DGPO 01ceb4b) on one process.
Loss values and gradients agree to relative 1e-6 on seeded tensors; docs/parity.md lists what differs.
"""
import math

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.losses.awm import AWMOptions, awm_log_prob, awm_loss
from flowrl.losses.dgpo import DGPOOptions, dgpo_loss
from flowrl.losses.flow_matching import TimeSampling, ramped_decay, sample_times
from flowrl.schedules import flow_sigmas

RTOL = 1e-6


def close(a, b, rtol=RTOL):
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-12)


def close_grad(a, b, rtol=RTOL):
    """Gradients agree relative to their norm (an element near 0 where terms cancel carries float32 noise)."""
    assert (a - b).norm() <= rtol * b.norm(), f"relative gradient difference {((a - b).norm() / b.norm()).item():.2e}"


# ---------------------------------------------------------------- Flow-Factory's TimeSampler, transcribed
def ff_logit_normal(n, lo, hi, shift, gen, mean=0.0, std=1.0):
    """TimeSampler.logit_normal_shifted (stratified): scheduler-scale t [n]."""
    u_base = torch.rand(n, generator=gen)
    base = (torch.arange(n) + u_base) / n
    z = torch.distributions.Normal(loc=0.0, scale=1.0).icdf(torch.clamp(base, 1e-7, 1 - 1e-7))
    z = z[torch.randperm(n, generator=gen)]
    raw = torch.sigmoid(z * std + mean)
    raw = torch.clamp(shift * raw / (1 + (shift - 1) * raw), min=0.01, max=1.0 - 1e-6)
    return 1000.0 * (1.0 - (lo + raw * (hi - lo)))


def ff_uniform(n, lo, hi, shift, gen):
    rand_u = torch.rand(n, generator=gen)
    f = lo + (torch.arange(n) + rand_u) / n * (hi - lo)
    f = f[torch.randperm(n, generator=gen)]
    if abs(shift - 1.0) > 1e-6:
        f = shift * f / (1 + (shift - 1) * f)
    return 1000.0 * (1.0 - f)


def ff_stratified(n, start, end, gen):
    b = torch.linspace(start, end, n + 1)
    lower, upper = b[:-1].long(), b[1:].long()
    return lower + (torch.rand(n, generator=gen) * (upper - lower)).long()


def ff_discrete(n, ts, lo, hi, include_init, force_init, gen):
    mask = (ts >= 1000.0 * (1.0 - hi) - 1e-3) & (ts <= 1000.0 * (1.0 - lo) + 1e-3)
    valid = torch.where(mask)[0]
    a, b = int(valid.min()), int(valid.max())
    if force_init:
        idx = torch.tensor([a]) if n == 1 else torch.cat([torch.tensor([a]), ff_stratified(n - 1, a + 1, b, gen)])
    else:
        idx = ff_stratified(n, a if include_init else a + 1, b, gen)
    return ts[idx.clamp(0, len(ts) - 1)]


SD35_14 = flow_sigmas(14, 3.0)[:-1]  # the AWM SD3.5-M recipe's 14 sampling steps


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("kind,num,frac,shift", [
    ("logit_normal", 6, (0.0, 0.9), 3.0), ("logit_normal", 5, (0.1, 0.8), 1.0),
    ("uniform", 6, (0.0, 0.9), 3.0), ("uniform", 4, (0.2, 1.0), 1.0),
    ("discrete", 4, (0.0, 0.6), 3.0), ("discrete_with_init", 4, (0.0, 0.9), 3.0),
    ("discrete_with_init", 1, (0.0, 0.9), 3.0), ("discrete_wo_init", 6, (0.0, 0.9), 3.0)])
def test_time_sampling_equals_flow_factory(seed, kind, num, frac, shift):
    opts = TimeSampling(kind=kind, num=num, fraction=frac, shift=shift)
    ours = sample_times(opts, SD35_14, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    ts = SD35_14 * 1000.0
    if kind == "logit_normal":
        t = ff_logit_normal(num, *frac, shift, g)
    elif kind == "uniform":
        t = ff_uniform(num, *frac, shift, g)
    else:
        init = {"discrete": (True, False), "discrete_with_init": (True, True), "discrete_wo_init": (False, False)}[kind]
        t = ff_discrete(num, ts, *frac, *init, g)
    assert torch.equal(ours, (t / 1000.0).clamp(0, 1))  # same draws, bit for bit


def test_time_sampling_by_hand():
    g = torch.Generator().manual_seed(3)
    # SD3.5-M AWM recipe: 14 steps, range 0.9 keeps steps 0..12 (sigma >= 0.1); wo_init strata [1] [2,3] .. [10,11]
    wo = sample_times(TimeSampling("discrete_wo_init", 6, 0.9), SD35_14, g)
    idx = [int((SD35_14 - s).abs().argmin()) for s in wo]
    assert [i in ({1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11})[k] for k, i in enumerate(idx)] == [True] * 6
    assert sample_times(TimeSampling("discrete_with_init", 3, 0.9), SD35_14, g)[0] == 1.0  # the first step forced
    ln = sample_times(TimeSampling("logit_normal", 8, (0.0, 1.0), shift=1.0), None, g)
    assert ln.shape == (8,) and ((ln > 0) & (ln < 1)).all()
    u = sample_times(TimeSampling("uniform", 4, (0.0, 1.0), shift=1.0), None, g)
    assert sorted(int(4 * (1 - s)) for s in u.tolist()) == [0, 1, 2, 3]  # one per stratum
    with pytest.raises(ValueError, match="step_sigmas"):
        sample_times(TimeSampling("discrete"))
    with pytest.raises(ValueError, match="none after it"):
        sample_times(TimeSampling("discrete_wo_init", 2, 0.01), SD35_14)  # only step 0 has sigma >= 0.99
    with pytest.raises(ConfigError, match="choose one of"):
        TimeSampling("nope")
    with pytest.raises(ConfigError, match="0 <= lo < hi <= 1"):
        TimeSampling(fraction=(0.5, 0.2))
    assert ramped_decay(100, 0.3, 0.001) == pytest.approx(0.1) and ramped_decay(10**6, 0.3, 0.001) == 0.3


def _steps(sigmas):
    return [int((SD35_14 - s).abs().argmin()) for s in sigmas]


def test_time_range_keeping_a_single_step():
    """Flow-Factory's discrete draws, where the range keeps one step: ``_with_init`` (num > 1) and ``_wo_init``
    train the step after it (outside the range; ``_wo_init`` also the kept step it leaves out), flowrl refuses."""
    ts = SD35_14 * 1000.0
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    for frac, lo, hi in ((0.01, 0.0, 0.01), ((0.95, 1.0), 0.95, 1.0)):  # only step 0 / only step 13 inside
        kept = 0 if hi == 0.01 else 13
        for kind, num in (("discrete", 4), ("discrete_with_init", 1)):  # the kept step only, in both codes
            ours = sample_times(TimeSampling(kind, num, frac), SD35_14, g())
            assert _steps(ours) == [kept] * num
            init = (True, kind == "discrete_with_init")
            assert torch.equal(ours, ff_discrete(num, ts, lo, hi, *init, g()) / 1000.0)
        for kind, num, init in (("discrete_with_init", 4, (True, True)), ("discrete_wo_init", 4, (False, False)),
                                ("discrete_wo_init", 1, (False, False))):
            with pytest.raises(ValueError, match="none after it"):
                sample_times(TimeSampling(kind, num, frac), SD35_14, g())
            peer = _steps(ff_discrete(num, ts, lo, hi, *init, g()) / 1000.0)
            if kept == 0:  # step 1 (sigma 0.973, fraction 0.027) lies outside the range
                assert 1 in peer and set(peer) <= {0, 1}
                assert (0 in peer) == (num > 1)  # _wo_init with 4 times trains step 0 too
            else:  # the last step: the index clamp gives the kept step only (the one _wo_init leaves out)
                assert peer == [13] * num


# ---------------------------------------------------------------- AWM
def ff_weighted_log_prob(model_output, target, timestep, weighting, p):
    """AWMTrainer.compute_weighted_log_prob: timestep in 0..1000."""
    lp = -(model_output.double() - target.double()) ** 2
    lp = lp.mean(dim=tuple(range(1, lp.ndim)))
    t = (timestep.view(-1) / 1000.0).clamp(0.0, 1.0)
    if weighting == "Uniform":
        pass
    elif weighting == "t":
        lp = lp * t
    elif weighting == "t**2":
        lp = lp * t**2
    elif weighting == "huber":
        lp = -(torch.sqrt(-lp + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        eps = torch.tensor(1e-10, dtype=lp.dtype)
        lp = -(torch.pow(-lp + eps, p) - torch.pow(eps, p)) * t / p
    return lp.float()


def ff_awm_loss(v, v_old, v_ref, v_ema, noise, x0, timestep, adv, w, p, clip, adv_clip, kl_beta, ema_kl_beta):
    """One timestep of AWMTrainer.optimize: clipped ratio + v-based KL to the reference and the EMA."""
    target = noise - x0
    log_prob = ff_weighted_log_prob(v, target, timestep, w, p)
    old = ff_weighted_log_prob(v_old, target, timestep, w, p)
    adv = torch.clamp(adv, adv_clip[0], adv_clip[1])
    ratio = torch.exp(log_prob - old)
    loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 + clip[0], 1.0 + clip[1])))
    if kl_beta > 0:
        loss = loss + kl_beta * ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.ndim))).mean()
    if ema_kl_beta > 0:
        loss = loss + ema_kl_beta * ((v - v_ema) ** 2).mean(dim=tuple(range(1, v.ndim))).mean()
    return loss


FF_NAMES = {"uniform": "Uniform", "t": "t", "t2": "t**2", "huber": "huber", "ghuber": "ghuber"}


def _awm_inputs(seed=0, b=6):
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(b, 4, 6, 6, generator=g), torch.randn(b, 4, 6, 6, generator=g)
    v_old = noise - x0 + 0.3 * torch.randn(b, 4, 6, 6, generator=g)
    v = (v_old + 0.05 * torch.randn(b, 4, 6, 6, generator=g)).requires_grad_(True)
    v_ref = v_old + 0.1 * torch.randn(b, 4, 6, 6, generator=g)
    v_ema = v_old + 0.02 * torch.randn(b, 4, 6, 6, generator=g)
    timestep = SD35_14[torch.randint(0, 13, (b,), generator=g)] * 1000.0
    adv = 1.5 * torch.randn(b, generator=g)
    return x0, noise, v, v_old, v_ref, v_ema, timestep, adv


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
@pytest.mark.parametrize("clip,adv_clip,kl,ema_kl", [((-1.0, 1.0), (-1.0, 1.0), 1e-4, 1.0),  # SD3.5-M recipe
                                                    ((-1e-4, 1e-4), (-5.0, 5.0), 0.0, 0.0),  # Flow-Factory defaults
                                                    ((-0.01, 0.02), (-5.0, 5.0), 0.5, 0.0)])
def test_awm_loss_and_gradient_equal_flow_factory(weighting, clip, adv_clip, kl, ema_kl):
    x0, noise, v, v_old, v_ref, v_ema, timestep, adv = _awm_inputs()
    sigma = (timestep / 1000.0).clamp(0, 1)
    opts = AWMOptions(weighting=weighting, clip_range=clip, adv_clip=adv_clip, beta_kl=kl, beta_ema_kl=ema_kl)
    old = awm_log_prob(v_old, noise - x0, sigma, weighting)
    ours, stats = awm_loss(v, noise - x0, sigma, old, adv, opts, v_ref=v_ref, v_ema=v_ema)
    (g_ours,) = torch.autograd.grad(ours, v)
    peer = ff_awm_loss(v, v_old, v_ref, v_ema, noise, x0, timestep, adv, FF_NAMES[weighting], 0.25, clip, adv_clip, kl, ema_kl)
    (g_peer,) = torch.autograd.grad(peer, v)
    close(ours, peer)
    close_grad(g_ours, g_peer)
    assert g_ours.abs().sum() > 0 and 0 <= stats["clip_frac_high"] <= 1


def test_awm_by_hand():
    b = 4
    target = torch.zeros(b, 2, 3, 3)
    v = torch.full((b, 2, 3, 3), 2.0)  # error e = 4 everywhere
    sigma = torch.full((b,), 0.5)
    want = {"uniform": -4.0, "t": -2.0, "t2": -1.0, "huber": -(math.sqrt(4 + 1e-10) - 1e-5) * 0.5,
            "ghuber": -((4 + 1e-10) ** 0.25 - 1e-10 ** 0.25) * 0.5 / 0.25}
    for w, value in want.items():
        close(awm_log_prob(v, target, sigma, w), torch.full((b,), value, dtype=torch.float32))
    assert awm_log_prob(target, target, sigma, "huber").abs().max() < 1e-9  # exact fit: 0 in every weighting
    # zero advantages: no policy gradient; identical old policy: ratio 1, policy loss -mean(A)
    x0, noise, v, v_old, _, _, timestep, adv = _awm_inputs(1)
    sigma = timestep / 1000
    opts = AWMOptions(weighting="ghuber", clip_range=1, adv_clip=1)
    loss, _ = awm_loss(v, noise - x0, sigma, awm_log_prob(v_old, noise - x0, sigma, "ghuber"), torch.zeros(len(adv)), opts)
    assert loss == 0 and torch.autograd.grad(loss, v)[0].abs().max() == 0
    same = awm_log_prob(v.detach(), noise - x0, sigma, "ghuber")
    loss, stats = awm_loss(v, noise - x0, sigma, same, adv, opts)
    close(loss, -adv.clamp(-1, 1).mean())
    assert stats["ratio_mean"] == 1
    scaled, _ = awm_loss(v, noise - x0, sigma, same, adv, AWMOptions("ghuber", adv_clip=5, adv_scale=0.2))  # official code's A/5
    close(scaled, -(adv.clamp(-5, 5) * 0.2).mean())
    with pytest.raises(ValueError, match="needs v_ref"):
        awm_loss(v, noise - x0, sigma, same, adv, AWMOptions(beta_kl=0.1))
    with pytest.raises(ConfigError, match="weighting"):
        AWMOptions(weighting="Uniform")
    assert AWMOptions(clip_range=1).clip_range == (-1.0, 1.0)
    with pytest.raises(ConfigError, match="lo < hi"):
        AWMOptions(clip_range=(0.1, -0.1))


# ---------------------------------------------------------------- DGPO
def ff_dgpo_loss(v, v_ref, v_old, target, adv, groups, beta_dpo, group_size, clip, adv_clip,
                 clip_dsm, clip_kl, use_ema_ref, kl_beta):
    """DGPOTrainer._optimize_step's loss for one (micro-batch, timestep), one process."""
    b = v.shape[0]
    adv = torch.clamp(adv, adv_clip[0], adv_clip[1])
    dsm = (target - v).square().reshape(b, -1).mean(dim=1)
    should_clip = None
    if clip_dsm or clip_kl:
        old_dsm = (target - v_old).square().reshape(b, -1).mean(dim=1)
        ratio = torch.exp(-dsm.detach() + old_dsm)
        should_clip = torch.where(adv > 0, ratio > 1.0 + clip[1], ratio < 1.0 + clip[0])
        if clip_dsm:
            dsm = torch.where(should_clip, dsm.detach(), dsm)
    ref = v_old if use_ema_ref else v_ref
    with torch.no_grad():
        ref_dsm = (target - ref).square().reshape(b, -1).mean(dim=1)
    per_sample = adv * beta_dpo * (dsm.detach() - ref_dsm) / group_size
    _, inverse = torch.unique(groups, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1, dtype=per_sample.dtype).scatter_add_(0, inverse, per_sample)
    weights = torch.sigmoid(sums)[inverse].detach()
    loss = (weights * adv * dsm).mean()
    if kl_beta > 0:
        kl = (v - v_ref).square().reshape(b, -1).mean(dim=1)
        if clip_kl and should_clip is not None:
            kl = torch.where(should_clip, kl.detach(), kl)
        loss = loss + kl_beta * kl.mean()
    return loss


def _dgpo_inputs(seed=0, groups=3, per=4):
    g = torch.Generator().manual_seed(seed)
    b = groups * per
    x0 = torch.randn(b, 4, 5, 5, generator=g)
    noise = torch.randn(groups, 4, 5, 5, generator=g).repeat_interleave(per, 0)  # shared within a group
    v_ref = noise - x0 + 0.3 * torch.randn(b, 4, 5, 5, generator=g)
    v_old = v_ref + 0.05 * torch.randn(b, 4, 5, 5, generator=g)
    v = (v_old + 0.05 * torch.randn(b, 4, 5, 5, generator=g)).requires_grad_(True)
    adv = torch.randn(b, generator=g) * 2
    group_index = torch.arange(groups).repeat_interleave(per)
    return v, v_ref, v_old, noise - x0, adv, group_index


@pytest.mark.parametrize("clip_dsm,clip_kl,use_ema_ref,kl,clip,beta_dpo", [
    (True, False, False, 0.001, (-0.05, 0.05), 10.0),  # SD3.5-M PickScore recipe
    (True, False, False, 0.02, (-0.01, 0.01), 100.0),  # GenEval / OCR
    (True, False, True, 0.001, (-1e-5, 1e-5), 2000.0),  # CFG-free, dynamic EMA reference
    (True, True, False, 0.01, (-0.002, 0.001), 50.0), (False, False, False, 0.0, (-0.01, 0.01), 100.0)])
def test_dgpo_loss_and_gradient_equal_the_peers(clip_dsm, clip_kl, use_ema_ref, kl, clip, beta_dpo):
    v, v_ref, v_old, target, adv, groups = _dgpo_inputs()
    opts = DGPOOptions(group_size=4, beta_dpo=beta_dpo, clip_range=clip, clip_dsm=clip_dsm, clip_kl=clip_kl,
                       use_ema_ref=use_ema_ref, beta_kl=kl)
    ours, stats = dgpo_loss(v, target, adv, groups, opts, v_ref=v_ref, v_old=v_old)
    (g_ours,) = torch.autograd.grad(ours, v)
    peer = ff_dgpo_loss(v, v_ref, v_old, target, adv, groups, beta_dpo, 4, clip, (-5.0, 5.0),
                        clip_dsm, clip_kl, use_ema_ref, kl)
    (g_peer,) = torch.autograd.grad(peer, v)
    close(ours, peer)
    close_grad(g_ours, g_peer)
    assert g_ours.abs().sum() > 0 and 0 < stats["group_weight_mean"] < 1


def test_dgpo_is_the_gradient_of_the_group_preference_objective():
    """Without clipping, grad of the surrogate = G / (beta B) * grad sum_g softplus(S_g) (module doc)."""
    v, v_ref, _, target, adv, groups = _dgpo_inputs(2)
    beta, size = 40.0, 4
    opts = DGPOOptions(group_size=size, beta_dpo=beta, clip_dsm=False)
    loss, _ = dgpo_loss(v, target, adv, groups, opts, v_ref=v_ref)
    (g_loss,) = torch.autograd.grad(loss, v)
    dsm = (v - target).pow(2).flatten(1).mean(1)
    ref = (v_ref - target).pow(2).flatten(1).mean(1)
    s = torch.zeros(3).index_add(0, groups, adv * beta * (dsm - ref) / size)
    (g_obj,) = torch.autograd.grad(torch.nn.functional.softplus(s).sum(), v)
    close_grad(g_loss, g_obj * size / (beta * len(adv)), rtol=1e-5)


def test_dgpo_by_hand():
    v, v_ref, v_old, target, adv, groups = _dgpo_inputs(3)
    opts = DGPOOptions(group_size=4, beta_dpo=10.0, clip_range=0.01)
    loss, _ = dgpo_loss(v, target, torch.zeros_like(adv), groups, opts, v_ref=v_ref, v_old=v_old)
    assert loss == 0 and torch.autograd.grad(loss, v)[0].abs().max() == 0  # zero advantages: nothing to learn
    # the policy equal to the reference: S_g = 0, every weight sigmoid(0) = 1/2
    _, stats = dgpo_loss(v_ref.clone().requires_grad_(True), target, adv, groups, DGPOOptions(group_size=4, clip_dsm=False),
                         v_ref=v_ref)
    assert stats["group_weight_mean"] == 0.5 and stats["preference_loss"] == pytest.approx(math.log(2))
    # the clip is one-sided: a better-fitted sample (ratio > 1) is clipped only when A > 0
    from flowrl.losses.dgpo import dsm_clip_mask
    dsm, old = torch.tensor([1.0, 1.0, 1.2, 1.2]), torch.tensor([1.2, 1.2, 1.0, 1.0])
    assert dsm_clip_mask(dsm, old, torch.tensor([1.0, -1.0, 1.0, -1.0]), (-0.01, 0.01)).tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="needs v_old"):
        dgpo_loss(v, target, adv, groups, DGPOOptions(group_size=4), v_ref=v_ref)
    with pytest.raises(ConfigError, match="group_size"):
        DGPOOptions(group_size=1)
    assert DGPOOptions(clip_dsm=False).needs_old is False and DGPOOptions(use_ema_ref=True, clip_dsm=False).needs_old
