"""Reward-ranking fidelity of a low-precision copy: Kendall tau-b, Spearman rho, top-k hit rate.

Sol-RL (arXiv 2604.06916) measures how well FP4 exploration ranks a prompt's seeds compared
with BF16 (FLUX: Kendall tau 0.798, Spearman 0.927, top-12 hit rate 93.3%). Rankings are
compared within a group (the seeds of one prompt) and averaged over groups; non-finite
rewards are dropped pairwise.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch


def _arr(x) -> np.ndarray:
    return torch.as_tensor(x).detach().double().cpu().numpy().reshape(-1)


def kendall_tau(x, y) -> float:
    """Kendall tau-b of two equally long score vectors (ties handled as in scipy); NaN if undefined."""
    a, b = _arr(x), _arr(y)
    if a.shape != b.shape:
        raise ValueError(f"kendall_tau got vectors of lengths {a.size} and {b.size}")
    n = a.size
    if n < 2:
        return float("nan")
    iu = np.triu_indices(n, k=1)
    da = np.sign(a[:, None] - a[None, :])[iu]  # [n (n - 1) / 2]
    db = np.sign(b[:, None] - b[None, :])[iu]
    n0 = da.size
    denom = math.sqrt(float(np.count_nonzero(da)) * float(np.count_nonzero(db)))
    return float((da * db).sum() / denom) if denom > 0 and n0 > 0 else float("nan")


def _average_ranks(v: np.ndarray) -> np.ndarray:
    _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # 1-based rank of the last member of each tie group
    return (ends - (counts - 1) / 2.0)[inv]


def spearman(x, y) -> float:
    """Spearman rho (Pearson correlation of average ranks); NaN if a vector is constant."""
    a, b = _arr(x), _arr(y)
    if a.shape != b.shape:
        raise ValueError(f"spearman got vectors of lengths {a.size} and {b.size}")
    if a.size < 2:
        return float("nan")
    ra, rb = _average_ranks(a), _average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def topk_hit_rate(reference, test, k: int) -> float:
    """Fraction of the ``k`` best by ``reference`` that are also among the ``k`` best by ``test``
    (ties broken by position, stably)."""
    a, b = _arr(reference), _arr(test)
    if a.shape != b.shape:
        raise ValueError(f"topk_hit_rate got vectors of lengths {a.size} and {b.size}")
    k = min(int(k), a.size)
    if k < 1:
        return float("nan")
    top_a = set(np.argsort(-a, kind="stable")[:k].tolist())
    top_b = set(np.argsort(-b, kind="stable")[:k].tolist())
    return len(top_a & top_b) / k


def ranking_fidelity(reference, test, groups: Optional[torch.Tensor] = None, k: int = 12) -> dict[str, float]:
    """Kendall tau, Spearman and top-``k`` hit rate of ``test`` against ``reference`` scores,
    each computed within every group (``groups`` [N] ids; None = one group) and averaged.

    Returns ``{"kendall_tau", "spearman", "topk_hit_rate", "k", "groups"}`` (groups that keep
    fewer than two finite pairs are left out of the means).
    """
    a, b = _arr(reference), _arr(test)
    g = np.zeros(a.size, dtype=np.int64) if groups is None else _arr(groups).astype(np.int64)
    if not (a.size == b.size == g.size):
        raise ValueError(f"ranking_fidelity got {a.size} reference, {b.size} test scores and {g.size} group ids")
    taus, rhos, hits = [], [], []
    for gid in np.unique(g):
        m = (g == gid) & np.isfinite(a) & np.isfinite(b)
        if m.sum() < 2:
            continue
        taus.append(kendall_tau(a[m], b[m]))
        rhos.append(spearman(a[m], b[m]))
        hits.append(topk_hit_rate(a[m], b[m], k))

    def mean(v: list[float]) -> float:
        v = [x for x in v if not math.isnan(x)]
        return float(np.mean(v)) if v else float("nan")

    return {"kendall_tau": mean(taus), "spearman": mean(rhos), "topk_hit_rate": mean(hits), "k": int(k),
            "groups": len(taus)}
