"""GDRO and Diffusion-DPO (docs/algorithms.md §8): group ranking losses on implicit rewards.

GDRO, "Group Direct Reward Optimization" (arXiv 2601.02036): offline, sampler-free. A group of
``k`` images of one prompt, generated once by the reference model and ranked by an explicit
reward, trains the policy through the *implicit reward* of each image,

    s_i = -beta * (||v* - v_theta(x_t)||^2 - ||v* - v_ref(x_t)||^2),
    x_t = (1 - t) x0_i + t eps,  v* = eps - x0_i,

with one ``(t, eps)`` shared by the whole group, and a Plackett-Luce loss over the ranking with
soft targets ``q_i = softmax_{j>=i}(r_j / tau)``. With ``k = 2`` and ``tau -> 0`` it is exactly
Diffusion-DPO (arXiv 2311.12908, eq. 14 in its flow-matching form): ``-log sigmoid(s_w - s_l)``.

Norms are **means over the non-batch dims** (per-element mean squared error, the habit of the
Diffusion-DPO code), so ``beta`` does not scale with the latent size. All math is float32.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F

from ..sde import flow_interpolate
from ..types import Conditioning, index_cond


def implicit_rewards(err: torch.Tensor, err_ref: torch.Tensor, beta: float) -> torch.Tensor:
    """``s = -beta * (err - err_ref)`` (GDRO arXiv 2601.02036, docs/algorithms.md §8), any shape, float32.

    ``err`` / ``err_ref``: per-image mean squared velocity errors of the policy / reference,
    e.g. ``[G, k]``. Positive ``s``: the policy fits the image better than the reference does.
    """
    return -float(beta) * (err.float() - err_ref.float())


def _sort_groups(implicit: torch.Tensor, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ``[G, k]`` reordered per group by reward, descending.

    Ties in reward are broken by the (detached) implicit reward, descending, so the loss is a
    function of the set of (reward, implicit reward) pairs: invariant to the input order.
    """
    o1 = torch.sort(implicit.detach(), dim=1, descending=True, stable=True).indices  # [G, k]
    r1 = rewards.gather(1, o1)
    o2 = torch.sort(r1, dim=1, descending=True, stable=True).indices  # [G, k]
    order = o1.gather(1, o2)  # [G, k]
    return implicit.gather(1, order), rewards.gather(1, order)


def plackett_luce_terms(implicit: torch.Tensor, rewards: torch.Tensor, tau: float) -> torch.Tensor:
    """Per-position GDRO terms ``[G, k]`` (position ``i`` in reward order, descending):

        term_i = logsumexp_{m>=i} s_m - sum_{j>=i} q_i(j) s_j,   q_i = softmax_{j>=i}(r_j / tau)

    (GDRO arXiv 2601.02036, docs/algorithms.md §8). The last position's term is 0 (a one-element suffix).
    ``tau = 0`` is the hard limit: ``q_i`` is one-hot on position ``i`` (plain Plackett-Luce).
    """
    s, r = _sort_groups(implicit.float(), rewards.float())  # [G, k] each, reward-descending
    k = s.shape[1]
    j = torch.arange(k, device=s.device)
    suffix = j.view(1, k) >= j.view(k, 1)  # [k(i), k(j)], True where j >= i
    s_ik = s.unsqueeze(1).expand(-1, k, -1)  # [G, k(i), k(j)]
    lse = torch.logsumexp(s_ik.masked_fill(~suffix, float("-inf")), dim=2)  # [G, k]
    if tau > 0:
        logits = (r / float(tau)).unsqueeze(1).expand(-1, k, -1)  # [G, k(i), k(j)]
        q = torch.softmax(logits.masked_fill(~suffix, float("-inf")), dim=2)  # [G, k, k], rows sum to 1
    else:
        q = torch.eye(k, device=s.device, dtype=s.dtype).expand(s.shape[0], k, k)  # [G, k, k]
    target = (q * s_ik.masked_fill(~suffix, 0.0)).sum(dim=2)  # [G, k]
    return lse - target  # [G, k]


def gdro_loss(implicit: torch.Tensor, rewards: torch.Tensor, tau: float) -> torch.Tensor:
    """GDRO Plackett-Luce loss (arXiv 2601.02036, docs/algorithms.md §8), **mean over groups** -> scalar.

    ``implicit`` [G, k]: implicit rewards ``s`` (see :func:`implicit_rewards`); ``rewards``
    [G, k]: explicit rewards (finite); ``tau >= 0``: target temperature (0 = hard ranking).
    Per group: ``sum_{i=1}^{k-1} [logsumexp_{m>=i} s_m - sum_{j>=i} q_i(j) s_j]`` in reward order.
    """
    if implicit.ndim != 2 or implicit.shape != rewards.shape:
        raise ValueError(f"gdro_loss needs implicit rewards and rewards of the same shape [G, k], got "
                         f"{tuple(implicit.shape)} and {tuple(rewards.shape)}")
    if implicit.shape[1] < 2:
        raise ValueError(f"gdro_loss needs groups of k >= 2 samples, got k = {implicit.shape[1]}")
    if not tau >= 0:
        raise ValueError(f"tau must be >= 0 (0 = hard ranking), got {tau}")
    if not torch.isfinite(rewards).all():
        raise ValueError("gdro_loss got non-finite rewards; drop those groups first (the offline trainer does)")
    return plackett_luce_terms(implicit, rewards, tau).sum(dim=1).mean()


def dpo_loss(implicit_win: torch.Tensor, implicit_lose: torch.Tensor) -> torch.Tensor:
    """Diffusion-DPO (arXiv 2311.12908, eq. 14): ``-log sigmoid(s_w - s_l)``, **mean** over pairs.

    ``implicit_win`` / ``implicit_lose`` [N]: implicit rewards of the preferred / rejected image
    of each pair (same ``(t, eps)`` within a pair), ``s`` as in :func:`implicit_rewards`.
    """
    return -F.logsigmoid(implicit_win.float() - implicit_lose.float()).mean()


def flow_matching_error(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image ``mean_dims((v* - v)^2)`` -> ``[B]`` float32 (``velocity``, ``target`` [B, ...])."""
    d = (target.float() - velocity.float()) ** 2
    return d.flatten(1).mean(dim=1)  # [B]


def group_velocity_errors(policy, reference: Optional[Callable[[], ContextManager]], x0: torch.Tensor,
                          cond: Conditioning, t: torch.Tensor, eps: torch.Tensor,
                          autocast: Callable[[], ContextManager] = contextlib.nullcontext
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocity errors of the policy (with grad) and the reference (no grad) on every group image.

    ``x0`` [G, k, C, H, W] clean latents; ``cond``: conditioning with G rows (one per group's
    prompt); ``t`` [G] in (0, 1); ``eps`` [G, C, H, W], shared by the group (GDRO). Builds
    ``x_t = (1 - t) x0 + t eps``, ``v* = eps - x0`` and returns ``(err, err_ref)``, each
    ``[G, k]`` float32, per-image mean over dims. ``reference()`` is a context inside which
    ``policy.velocity`` evaluates the reference (``flowrl.trainable.Reference.active``);
    ``None`` gives ``err_ref = err.detach()`` (no reference term). One batched pass of ``G * k``
    rows each.
    """
    g, k = x0.shape[:2]
    if t.shape != (g,) or eps.shape != (g, *x0.shape[2:]):
        raise ValueError(f"x0 {tuple(x0.shape)} needs t of shape [{g}] and eps of shape [{g}, "
                         f"{', '.join(map(str, x0.shape[2:]))}], got {tuple(t.shape)} and {tuple(eps.shape)}")
    x0 = x0.float()
    tt = t.float().view(g, 1, *([1] * (x0.ndim - 2)))  # [G, 1, 1, 1, 1]
    e = eps.float().unsqueeze(1)  # [G, 1, C, H, W]
    xt = flow_interpolate(x0, e, tt).flatten(0, 1)  # [G*k, C, H, W]
    target = (e - x0).flatten(0, 1)  # [G*k, C, H, W]
    sig = t.float().repeat_interleave(k)  # [G*k]
    c = index_cond(cond, torch.arange(g).repeat_interleave(k))  # G*k rows
    with autocast():
        v = policy.velocity(xt, sig, c)  # [G*k, C, H, W]
    err = flow_matching_error(v, target.to(v.device)).view(g, k)  # [G, k]
    if reference is None:
        return err, err.detach()
    with torch.no_grad(), reference(), autocast():
        v_ref = policy.velocity(xt, sig, c)  # [G*k, C, H, W]
    err_ref = flow_matching_error(v_ref, target.to(v_ref.device)).view(g, k)  # [G, k]
    return err, err_ref


def usable_groups(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G]`` masks: (finite: every reward finite, ranked: finite and not all equal).
    Groups whose rewards are all equal carry no ranking and are left out (logged). Shared by offline GDRO
    and the online preference updates."""
    finite = torch.isfinite(r).all(dim=1)  # [G]
    spread = torch.where(finite, r.max(dim=1).values - r.min(dim=1).values, torch.zeros(r.shape[0]))
    return finite, finite & (spread > 0)


def ranking_stats(implicit: torch.Tensor, rewards: torch.Tensor) -> dict:
    """Diagnostics over ``[G, k]`` groups: fraction of groups whose top-reward image has the
    highest implicit reward (``top1_accuracy``), and the mean implicit-reward margin of the
    top over the bottom image (``margin``)."""
    with torch.no_grad():
        s, r = _sort_groups(implicit.float(), rewards.float())
        return {"top1_accuracy": float((s[:, 0] >= s.max(dim=1).values).float().mean()),
                "margin": float((s[:, 0] - s[:, -1]).mean()),
                "implicit_reward_mean": float(s.mean())}
