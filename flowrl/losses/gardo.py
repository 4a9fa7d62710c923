"""GARDO: gated and adaptive regularisation with diversity-aware optimisation (He et al.,
arXiv 2512.24138; docs/algorithms.md §14). It wraps GRPO or DiffusionNFT with three parts:

1. **Gated KL.** Only samples whose main reward is *uncertain* are regularised. Uncertainty is
   rank disagreement over the whole (gathered) batch: with ``rank(r)`` 1 for the highest reward,
   ``u = rank(r_main) - mean_k rank(r_aux_k)`` (the peers use two auxiliary rewards, Aesthetic and
   ImageReward). Among ``u >= 0`` the gate keeps the top ``fraction``:
   ``gate = u > percentile(u[u >= 0], 100 (1 - fraction))``. ``fraction`` (start 0.1) adapts per
   iteration on the mean ``m`` of ``u[u >= 0]``: x1.1 if ``m`` exceeds every one of the last 20 such
   means, x0.9 if it is below all of them, clipped to ``[0.02, 0.2]`` (the peers' ``RiskCompensator``).
   The KL term is the mean over gated rows only: GRPO's Gaussian-step KL (Flow-GRPO form), NFT's
   velocity distance; with no gated row GRPO adds 0, NFT falls back to all rows.
2. **Adaptive reference.** The reference is a copy of the policy (a LoRA adapter ``old``),
   refreshed from the current weights when an optimizer step's logged (gated, unweighted) KL
   exceeded ``kl_threshold`` in the last iteration (not at iteration 0), or when more than
   ``period`` (15) iterations passed since the last refresh.
3. **Diversity-aware advantages.** Per prompt group, with ``f`` unit-normalised image features
   (DINOv3 ViT-L/16 in the peers), ``d_i = min_{j != i} (1 - cos(f_i, f_j))`` is the distance to
   the nearest other sample of the group, and
   ``A_i = (r_i - mean_g r) * (d_i / mean_g d  if r_i >= mean_g r  else 1)``: an above-average
   sample is scaled up when it is farther from its nearest neighbour than the group's average.
   The peers' code does **not** divide by a reward std here (the advantage is in reward units),
   then clips to ``+-adv_clip_max`` as usual.

Source: tinnerhrhe/GARDO (commit 1cc77fb): ``scripts/train_sd3_grpo_gardo.py``,
``scripts/train_flux_grpo_gardo.py``, ``scripts/train_sd3_nft_gardo.py``, ``flow_grpo/stat_tracking.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch


def reward_ranks(rewards: torch.Tensor) -> torch.Tensor:
    """``[N]`` rewards -> ``[N]`` float32 ranks, 1 for the highest (ties: first row first)."""
    order = torch.sort(rewards.detach().float().cpu(), descending=True, stable=True).indices  # [N]
    ranks = torch.empty(order.numel(), dtype=torch.long)
    ranks[order] = torch.arange(1, order.numel() + 1)
    return ranks.float()


def rank_uncertainty(main: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
    """GARDO's uncertainty ``u = rank(main) - mean_k rank(aux_k)`` over the whole batch -> ``[N]`` float32.

    ``u > 0``: the main (trained) reward ranks the sample lower than the auxiliary rewards do.
    """
    if not aux:
        raise ValueError("rank_uncertainty needs at least one auxiliary reward (the peers use Aesthetic and ImageReward)")
    return reward_ranks(main) - sum(reward_ranks(a) for a in aux) / len(aux)


@dataclass(frozen=True)
class UncertaintyGate:
    """The adaptive gated fraction (the peers' ``RiskCompensator``): a frozen record, checkpointable
    as ``(fraction, history)``; :meth:`update` returns the next record."""

    fraction: float = 0.1
    history: tuple[float, ...] = ()  # the last ``window`` means of the non-negative uncertainties
    base: float = 0.1
    rate: float = 0.1
    low: float = 0.02
    high: float = 0.2
    window: int = 20

    def update(self, nonneg: torch.Tensor) -> "UncertaintyGate":
        """The record after one iteration whose non-negative uncertainties are ``nonneg`` [K]."""
        m = float(nonneg.double().mean())
        f = self.fraction
        if not self.history:
            f = self.base
        elif m > max(self.history):
            f = f * (1 + self.rate)
        elif m < min(self.history):
            f = f * (1 - self.rate)
        f = float(np.clip(f, self.low, self.high))
        return replace(self, fraction=f, history=(self.history + (m,))[-self.window:])


def uncertainty_gate(uncertainty: torch.Tensor, fraction: float) -> tuple[torch.Tensor, float]:
    """``gate = u > percentile(u[u >= 0], 100 - 100 fraction)`` (numpy's linear percentile) -> (``[N]`` bool, threshold)."""
    u = uncertainty.detach().float().cpu()
    nonneg = u[u >= 0].numpy()
    if nonneg.size == 0:
        raise ValueError("uncertainty_gate: no sample has u >= 0 (rank uncertainties average 0, so a batch always has one)")
    threshold = float(np.percentile(nonneg, 100 - fraction * 100))
    return uncertainty > threshold, threshold


def gardo_gate(main: torch.Tensor, aux: Sequence[torch.Tensor], state: UncertaintyGate
               ) -> tuple[torch.Tensor, UncertaintyGate, dict[str, float]]:
    """One iteration's gate from the rewards of the whole batch: ``(gate [N] bool, next state, stats)``.

    The fraction is updated first, then used (the peers' order).
    """
    u = rank_uncertainty(main, aux)  # [N]
    state = state.update(u[u >= 0])
    gate, threshold = uncertainty_gate(u, state.fraction)
    return gate, state, {"gate_fraction": state.fraction, "gate_threshold": threshold,
                         "gated_share": gate.float().mean().item()}


def gated_mean(values: torch.Tensor, gate: torch.Tensor, *, when_empty: str = "zero") -> torch.Tensor:
    """Mean of per-row ``values`` [M] over the gated rows -> scalar.

    ``when_empty``: with no gated row, ``"zero"`` gives 0 (GARDO on GRPO) and ``"all"`` the mean
    over every row (GARDO on DiffusionNFT).
    """
    if when_empty not in ("zero", "all"):
        raise ValueError(f"gated_mean: when_empty must be 'zero' or 'all', got {when_empty!r}")
    if bool(gate.any()):
        return values[gate].mean()
    return values.mean() if when_empty == "all" else values.new_zeros(())


def should_refresh(iteration: int, last_refresh: int, kl_exceeded: bool, *, period: int = 15) -> bool:
    """Whether the reference is copied from the policy before this iteration's update.

    ``kl_exceeded``: an optimizer step of the previous iteration logged a gated KL above the
    threshold (ignored at iteration 0); ``period``: the longest gap, in iterations, between refreshes.
    """
    return (kl_exceeded and iteration != 0) or (iteration - last_refresh) > period


def nft_threshold_after_refresh(threshold: float, gap: int) -> float:
    """The KL threshold after a refresh ``gap`` iterations after the previous one (GARDO's NFT script,
    which starts at 0.15). Reproduced as written: ``gap > 15`` lowers it by 0.01 to at least 0.1;
    ``gap < 5`` sets ``min(threshold + 0.01, 0.05)``, i.e. 0.05 from any start above 0.04."""
    if gap > 15:
        threshold = max(threshold - 1e-2, 1e-1)
    if gap < 5:
        threshold = min(threshold + 1e-2, 5e-2)
    return threshold


def nearest_neighbour_distance(features: torch.Tensor) -> torch.Tensor:
    """``[G, D]`` features of one group -> ``[G]`` float64 cosine distance to the nearest other row."""
    if features.shape[0] < 2:
        raise ValueError("nearest_neighbour_distance needs a group of at least 2 samples")
    f = features.detach().double()
    f = f / f.norm(dim=1, keepdim=True)
    dist = 1.0 - (f @ f.T).clamp(-1.0, 1.0)  # [G, G]
    dist.fill_diagonal_(float("inf"))
    return dist.min(dim=1).values


def diversity_advantages(rewards: torch.Tensor, features: torch.Tensor, group_index: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """GARDO's diversity-aware advantages (module doc, part 3) -> ``(A [N] float32, weights [N] float32)``.

    Args:
        rewards: ``[N]`` main reward per finished sample.
        features: ``[N, D]`` image features (any scale: rows are unit-normalised here).
        group_index: ``[N]`` long, the prompt group of each sample (groups of >= 2).
    ``weights`` is the multiplier of ``r - mean_g r`` (1 below the group mean); a group whose
    features are all identical (``mean_g d = 0``) gets weights 1.
    """
    r = rewards.detach().double().cpu()
    adv = torch.zeros_like(r)
    weights = torch.ones_like(r)
    for g in torch.unique(group_index.cpu()):
        rows = torch.where(group_index.cpu() == g)[0]
        centred = r[rows] - r[rows].mean()  # [G]
        d = nearest_neighbour_distance(features[rows].cpu())  # [G]
        mean_d = d.mean()
        if mean_d > 0:
            weights[rows] = torch.where(centred < 0, torch.ones_like(d), d / mean_d)
        adv[rows] = centred * weights[rows]
    return adv.float(), weights.float()
