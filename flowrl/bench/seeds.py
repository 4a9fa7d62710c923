"""Several training seeds of one bench run: mean curves with 95% intervals over the seeds, and the time a
method takes to reach the baseline's final reward, with its interval. Pure functions on arrays.

**A seed's curve** is its evaluations ``[(x, y)]`` (x: training seconds or samples drawn; the first at x = 0,
the base model). Evaluations fall at different x in different seeds (a seed's iterations take their own
time), so each is read as a step function: at x, the value of its last evaluation at or before x (what the run
had reached when last measured), held at its final value after its last evaluation. :func:`on_grid` puts
the seeds on one grid, the union of their evaluation points: ``values [N, G]`` (N seeds, G grid points).
With one seed the grid is its own evaluations and the values its own.

**The mean curve** is the mean over seeds at each grid point; its interval the eval harness's bootstrap
(:func:`flowrl.eval.stats.bootstrap_mean`, the seeds as the resampled unit, 1000 resamples, percentile 95%
interval). With 3 seeds a percentile bootstrap cannot leave the range of the seeds' values (a resampled mean
of 3 runs lies between the lowest and the highest): read it as the spread of the runs, not a guarantee.

**The time to the baseline's final reward** (:func:`times_to_baseline`): the target is the baseline's
seed-mean final reward; a method's time is the first grid point where its seed-mean curve is at or above it
(inf: never within the budget); ``x fewer`` is the baseline's time over the method's. With one seed this is
the first evaluation at or above the baseline's final reward, as a single run reports it. The interval
(:func:`bootstrap_times`) resamples every method's seeds independently (the baseline's too, so the target
moves with them), 1000 times, recomputes target, times and ratios, and takes the 2.5% and 97.5% order
statistics (the nearest resampled values outward, so "never" in more than 2.5% of the resamples is an
infinite upper end rather than an interpolation with infinity). A resample whose target is not above the
base model's reward has no times and is left out.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..eval.stats import LEVEL, N_BOOT, Interval, bootstrap_mean

AXES = ("train_seconds", "samples")  # the x of the bench's curves: training seconds, samples drawn


def on_grid(curves: Sequence[Sequence[dict]], x: str, keys: Sequence[str]) -> tuple[np.ndarray, dict]:
    """The seeds' curves (each a list of evaluation points, dicts with ``x`` and ``keys``, ascending in ``x``,
    the first at the curves' common start) as step functions on the union of their ``x`` -> (grid ``[G]``,
    ``{key: values [N, G]}``) (module doc)."""
    grid = np.unique(np.concatenate([np.asarray([p[x] for p in c], dtype=np.float64) for c in curves]))  # [G]
    out = {}
    for key in keys:
        rows = []
        for c in curves:
            xs = np.asarray([p[x] for p in c], dtype=np.float64)  # [E]
            ys = np.asarray([p[key] for p in c], dtype=np.float64)  # [E]
            at = np.searchsorted(xs, grid, side="right") - 1  # [G] last evaluation at or before each grid x
            if (at < 0).any():
                raise ValueError(f"a curve starts at {x}={xs[0]:g}, after another's {grid[0]:g}: the seeds' curves "
                                 f"must share their first point (the base model's evaluation)")
            rows.append(ys[at])
        out[key] = np.stack(rows)  # [N, G]
    return grid, out


def mean_intervals(values: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> list[Interval]:
    """``values [N, G]`` -> per grid point the mean over the N seeds with its bootstrap interval."""
    v = np.asarray(values, dtype=np.float64)
    return [bootstrap_mean(v[:, g], n_boot=n_boot, seed=seed) for g in range(v.shape[1])]


def first_reach(grid: np.ndarray, mean: np.ndarray, target: float) -> float:
    """First ``grid`` x where ``mean`` ``[G]`` is at or above ``target`` (inf: never)."""
    hit = np.flatnonzero(np.asarray(mean) >= target)
    return float(grid[hit[0]]) if hit.size else float("inf")


def _ratio(theirs: float, mine: float) -> float:
    """The baseline's time over a method's: 0 when the method never reaches it, NaN when undefined."""
    if not np.isfinite(theirs) or mine <= 0:
        return float("nan")
    return theirs / mine


def times_to_baseline(reward: dict, baseline: str, picks: Optional[dict] = None) -> Optional[dict]:
    """``reward``: ``{method: {axis: (grid [G], eval reward [N, G])}}`` for the :data:`AXES`; ``picks``:
    ``{method: seed indices}`` (a bootstrap resample; default every seed once) -> ``{method: {"<axis>": time,
    "speedup_<axis>": the baseline's time over the method's}}`` (time inf: never), or None when the target (the
    baseline's seed-mean final reward) is not above its first, the base model's, value."""
    def mean(name, axis):
        grid, v = reward[name][axis]
        idx = np.arange(len(v)) if picks is None else picks[name]
        return grid, v[idx].mean(axis=0)  # [G]

    _, base = mean(baseline, AXES[0])
    target = base[-1]
    if not target > base[0]:
        return None
    out = {name: {axis: first_reach(*mean(name, axis), target) for axis in AXES} for name in reward}
    for r in out.values():
        r.update({f"speedup_{axis}": _ratio(out[baseline][axis], r[axis]) for axis in AXES})
    return out


def outward_interval(stats: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """The ``(1 - level) / 2`` and ``(1 + level) / 2`` order statistics of ``stats``, rounded outward (no
    interpolation: inf stays inf); NaN left out; (NaN, NaN) when none is left."""
    x = np.asarray(stats, dtype=np.float64)
    x = x[~np.isnan(x)]
    if not x.size:
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(x, a, method="lower")), float(np.quantile(x, 1 - a, method="higher"))


def bootstrap_times(reward: dict, baseline: str, n_boot: int = N_BOOT, seed: int = 0,
                    level: float = LEVEL) -> Optional[dict]:
    """:func:`times_to_baseline` with intervals: ``{method: {key: Interval}}`` (``mean``: the point estimate
    on every seed, ``n``: the method's seeds), or None when the point estimate has no target (module doc)."""
    point = times_to_baseline(reward, baseline)
    if point is None:
        return None
    rng = np.random.default_rng(seed)
    sizes = {name: len(reward[name][AXES[0]][1]) for name in reward}
    boots = {name: {k: [] for k in r} for name, r in point.items()}
    for _ in range(n_boot):
        got = times_to_baseline(reward, baseline, {n: rng.integers(0, s, size=s) for n, s in sizes.items()})
        for name, r in (got or {}).items():
            for k, v in r.items():
                boots[name][k].append(v)
    return {name: {k: Interval(v, *outward_interval(boots[name][k], level), sizes[name]) for k, v in r.items()}
            for name, r in point.items()}
