"""Statistics of an evaluation, pure functions on score arrays ``[P, S]`` (P prompts x S seeds, NaN =
not applicable): means with bootstrap 95% intervals, paired deltas and win rates between two models
sampled with the same prompts and seeds.

The unit of resampling is the prompt (a cluster bootstrap: Efron & Tibshirani 1993, ch. 6; the
seeds of one prompt are not independent draws of the benchmark). A prompt's value is the mean over
its applicable seeds; prompts with none are left out. The interval is the percentile interval of
``n_boot`` resampled statistics; the generator is seeded, so a report is reproducible. With
``strata`` (each prompt's tag) prompts are resampled within their tag and the statistic is the mean
over tags of the tag means, GenEval's overall score (``summary_scores.py``): defined only when every
tag has a scored prompt (a mean over the tags that happen to have scores would be another number
under the same name), NaN otherwise; :func:`tag_coverage` says which tags have scores.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

N_BOOT = 1000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval; ``n`` prompts behind it (NaN everywhere when ``n`` is 0)."""

    mean: float
    lo: float
    hi: float
    n: int

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(self).items()}

    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of 0 (the difference is resolved)."""
        return self.n > 0 and (self.lo > 0 or self.hi < 0)


NAN = Interval(float("nan"), float("nan"), float("nan"), 0)


def prompt_means(scores: np.ndarray) -> np.ndarray:
    """``[P, S]`` -> ``[P]``: each prompt's mean over its finite entries (NaN when it has none)."""
    x = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)  # [P, S]
    ok = np.isfinite(x)
    count = ok.sum(axis=1)
    total = np.where(ok, x, 0.0).sum(axis=1)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _percentiles(stats: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    lo, hi = np.quantile(stats, [a, 1 - a])
    return float(lo), float(hi)


def bootstrap_mean(values: Sequence[float], strata: Optional[Sequence] = None, n_boot: int = N_BOOT,
                   seed: int = 0, level: float = LEVEL) -> Interval:
    """Mean of per-prompt ``values`` ``[P]`` (NaN left out) with its bootstrap interval (module doc);
    with ``strata`` ``[P]`` the mean over strata of the stratum means, resampled within strata (NaN,
    ``n`` 0, when a stratum has no finite value)."""
    v = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(v)
    if not keep.any() or (strata is not None and tag_coverage(v, strata)["tags_unscored"]):
        return NAN
    rng = np.random.default_rng(seed)
    if strata is None:
        x = v[keep]
        boots = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(axis=1)  # [n_boot]
        return Interval(float(x.mean()), *_percentiles(boots, level), int(len(x)))
    groups = np.asarray(strata, dtype=object)[keep]
    x = v[keep]
    means, boots = [], np.zeros(n_boot)
    labels = list(dict.fromkeys(groups.tolist()))
    for g in labels:
        xg = x[groups == g]
        means.append(xg.mean())
        boots += xg[rng.integers(0, len(xg), size=(n_boot, len(xg)))].mean(axis=1)
    return Interval(float(np.mean(means)), *_percentiles(boots / len(labels), level), int(len(x)))


def paired(a: np.ndarray, b: np.ndarray, n_boot: int = N_BOOT, seed: int = 0,
           level: float = LEVEL) -> tuple[Interval, Interval]:
    """Model B against model A on the same prompts and seeds, ``a``, ``b`` ``[P, S]``: (mean delta
    ``b - a``, win rate of B) with bootstrap intervals over prompts. A pair counts only where both
    are finite; a win is ``b > a``, a tie half a win. Per prompt: the mean over its pairs."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same prompts and seeds, got shapes {a.shape} and {b.shape}")
    both = np.isfinite(a) & np.isfinite(b)
    delta = np.where(both, b - a, np.nan)  # [P, S]
    win = np.where(both, (b > a) + 0.5 * (b == a), np.nan)  # [P, S]
    return (bootstrap_mean(prompt_means(delta), n_boot=n_boot, seed=seed, level=level),
            bootstrap_mean(prompt_means(win), n_boot=n_boot, seed=seed + 1, level=level))


def by_tag(values: Sequence[float], tags: Sequence, n_boot: int = N_BOOT, seed: int = 0) -> dict[str, Interval]:
    """Per-prompt ``values`` ``[P]`` summarised per tag (tags in order of first appearance)."""
    v, t = np.asarray(values, dtype=np.float64), np.asarray(tags, dtype=object)
    return {g: bootstrap_mean(v[t == g], n_boot=n_boot, seed=seed) for g in dict.fromkeys(t.tolist())}


def tag_coverage(values: Sequence[float], tags: Sequence) -> dict:
    """Which tags of per-prompt ``values`` ``[P]`` (NaN: no score) have scores: ``tags_scored`` and
    ``tags_unscored`` (in order of first appearance), ``prompts_scored`` (finite values) of ``prompts`` (P)."""
    v, t = np.asarray(values, dtype=np.float64), np.asarray(tags, dtype=object)
    ok = np.isfinite(v)
    labels = list(dict.fromkeys(t.tolist()))
    scored = [g for g in labels if ok[t == g].any()]
    return {"tags_scored": scored, "tags_unscored": [g for g in labels if g not in scored],
            "prompts_scored": int(ok.sum()), "prompts": int(len(v))}
