"""Several rewards into one advantage: the two rules of ``reward.aggregate``, and each reward's share of the
advantage's variance (docs/algorithms.md, "Several rewards"). Pure functions.

Every structure normalises rewards its own way (a flat group's mean and std, a tree depth's fused node values,
a TempFlow step's cell); each gives a :class:`Normalised`, the rewards centred on their normalisation group's
mean and the divisor, so that ``A = centred / scale``. With the weights ``w_k`` of ``reward.weights``:

    sum         A = clip( N(sum_k w_k r_k) )                the weighted sum normalised once
    per_reward  A = clip( sum_k w_k clip(N(r_k)) )          each reward normalised within its group first
                                                            (MixGRPO's advantage_aggr, arXiv 2507.21802;
                                                            Flow-Factory's advantage_aggregation: gdpo)

Each reward's contribution ``c_k`` to the advantage before its last clip (every normalisation subtracts a
group mean, which is linear in the rewards):

    sum         c_k = w_k centred(r_k) / scale(sum_j w_j r_j)
    per_reward  c_k = w_k clip(N(r_k))

so ``S = sum_k c_k`` is the advantage before its last clip, and reward ``k``'s share of the advantage's
variance is ``share_k = sum(c_k S) / sum(S^2)`` over the rows that train (:func:`variance_shares`): the shares
add up to 1; one near 1 drives training alone; a negative one is a reward the advantage trades away (it moves
against the others). The sums run over rows, not groups: a normalised advantage has mean 0 in every group, so
``sum(S^2)`` is its variance times the row count.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

RULES = ("sum", "per_reward")


@dataclass(frozen=True)
class Normalised:
    """Rewards normalised within their groups: ``A = centred / scale``."""

    centred: torch.Tensor  # [n] reward minus its normalisation group's mean; 0 where there is no signal
    scale: torch.Tensor    # [n] the divisor (std + eps, or a global std); 1 where there is no signal
    zero: torch.Tensor     # [n] bool: no signal (a constant or too small group, a non-finite reward)

    def advantages(self, clip: Optional[float]) -> torch.Tensor:
        """``centred / scale`` ``[n]``, clipped to ``+-clip`` (None: not clipped)."""
        a = self.centred / self.scale  # [n]
        return a if clip is None else a.clamp(-clip, clip)


Normaliser = Callable[[torch.Tensor], Normalised]  # rewards [n] -> their normalisation


@dataclass(frozen=True)
class Aggregated:
    """Advantages of several rewards under one rule (:func:`aggregate`)."""

    advantages: torch.Tensor  # [n] float, clipped
    zero: torch.Tensor        # [n] bool: no signal (per_reward: for no reward of non-zero weight)
    contributions: dict = field(default_factory=dict)  # name -> [n] float32 c_k (empty: components unknown)


def weighted(weights: Optional[Mapping[str, float]]) -> list[str]:
    """The names of ``weights`` with a non-zero weight, in order (a weight 0 is scored and logged, not trained)."""
    return [k for k, w in (weights or {}).items() if w != 0]


def check_components(components: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> None:
    """A ``ValueError`` when a reward of non-zero weight has no scores among ``components``."""
    missing = [k for k in weighted(weights) if k not in components]
    if missing:
        held = ", ".join(components) or "none (a reward object without components)"
        raise ValueError(f"reward.aggregate=per_reward normalises each reward apart, and the rollout holds no "
                         f"scores of {missing[0]!r} (it holds {held}); train with reward.weights naming every reward, "
                         f"or set reward.aggregate=sum")


def aggregate(normalise: Normaliser, total: torch.Tensor, components: Mapping[str, torch.Tensor],
              weights: Optional[Mapping[str, float]], per_reward: bool, clip: Optional[float]) -> Aggregated:
    """The advantages of ``total`` ``[n]`` (``sum_k w_k r_k``) or of its ``components`` (name -> ``[n]``) under
    one rule (module doc), with each reward's contribution.

    Args:
        normalise: the structure's normalisation of one reward (:class:`Normalised`); called once per reward
            of non-zero weight, and once for ``total`` under ``sum``.
        weights: ``reward.weights``; None: unknown (``sum`` only, no contributions).
        per_reward: the ``per_reward`` rule, else ``sum``.
        clip: each reward's advantage (``per_reward``) and the result are clipped to ``+-clip`` (None: not).
    """
    names = weighted(weights)
    if per_reward:
        check_components(components, weights or {})
        contrib, zero = {}, None
        for k in names:
            n = normalise(components[k])
            contrib[k] = float(weights[k]) * n.advantages(clip)  # [n]
            zero = n.zero if zero is None else zero & n.zero
        s = sum(contrib.values()) if contrib else torch.zeros_like(total)  # [n]
        zero = zero if zero is not None else torch.ones_like(total, dtype=torch.bool)
        return Aggregated(s if clip is None else s.clamp(-clip, clip), zero,
                          {k: v.float() for k, v in contrib.items()})
    n = normalise(total)
    contrib = {}
    if names and all(k in components for k in names):
        contrib = {k: torch.where(n.zero, 0.0, float(weights[k]) * normalise(components[k]).centred / n.scale).float()
                   for k in names}  # [n] each
    return Aggregated(n.advantages(clip), n.zero, contrib)


def share_sums(contributions: Mapping[str, torch.Tensor], mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[K + 1]`` float64: ``sum(c_k S)`` per reward (in the order of ``contributions``), then ``sum(S^2)``, over
    the rows of ``mask`` (``[n]`` bool; None: all) with every contribution finite. Sums of several processes add."""
    cs = [c.double().flatten() for c in contributions.values()]
    if not cs:
        return torch.zeros(1, dtype=torch.float64)
    c = torch.stack(cs)  # [K, n]
    keep = torch.isfinite(c).all(dim=0)  # [n]
    if mask is not None:
        keep &= mask.flatten().to(keep.device).bool()
    c = c[:, keep]  # [K, n']
    s = c.sum(dim=0)  # [n'] the advantage before its last clip
    return torch.cat([(c * s).sum(dim=1), (s * s).sum().view(1)])  # [K + 1]


def shares_from_sums(names: Sequence[str], sums: torch.Tensor) -> dict[str, float]:
    """``{name: share}`` from :func:`share_sums` (NaN when no row carries signal)."""
    total = float(sums[-1])
    return {k: (float(sums[i]) / total if total > 0 else float("nan")) for i, k in enumerate(names)}


def variance_shares(contributions: Mapping[str, torch.Tensor], mask: Optional[torch.Tensor] = None
                    ) -> dict[str, float]:
    """Each reward's share of the advantage's variance, ``sum(c_k S) / sum(S^2)`` (module doc); they add up to 1."""
    return shares_from_sums(list(contributions), share_sums(contributions, mask))
