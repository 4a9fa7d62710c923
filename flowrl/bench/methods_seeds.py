"""``flowrl bench methods --seeds N`` (N > 1): a method's N runs as one row, with 95% intervals over the seeds
(the math: :mod:`flowrl.bench.seeds`), its table and its picture (mean curves, shaded intervals)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..utils.io import save_figure
from .seeds import AXES, bootstrap_times, mean_intervals, on_grid
from .training import SECONDS, WATCH, finish_extra_panels, reference_lines

KEYS = ("eval_reward", "diversity", "hf_energy")  # the curve measures averaged over the seeds
TRAINED = "trained_reward"  # the trained reward's evaluation, when the world ranks by a held-out one (headline)
REWARD = ("eval_reward", "eval reward (fixed prompts and seeds)")
SAMPLES = ("samples", "samples drawn (scored by the reward)")
PANELS = [(SECONDS, REWARD), (SAMPLES, REWARD), *((SECONDS, w) for w in WATCH)]  # the 2 x 2 picture


def _finite(v: float):
    """JSON's value of a number: None for NaN and inf (a time never reached)."""
    return float(v) if math.isfinite(v) else None


def curve_keys(curves: list) -> tuple[str, ...]:
    """The measures the seeds' curves hold: :data:`KEYS`, and :data:`TRAINED` when every point has it."""
    return KEYS + ((TRAINED,) if all(TRAINED in p for c in curves for p in c) else ())


def mean_curves(curves: list, keys: Optional[tuple[str, ...]] = None) -> dict:
    """The seeds' curves -> ``{axis: [point]}`` per :data:`~flowrl.bench.seeds.AXES`: each point ``{axis: x,
    key: seed mean, key_lo, key_hi}`` for the ``keys`` (default: :func:`curve_keys`; step functions on the seeds'
    union grid)."""
    out, keys = {}, keys or curve_keys(curves)
    for axis in AXES:
        grid, values = on_grid(curves, axis, keys)
        iv = {k: mean_intervals(values[k]) for k in keys}
        out[axis] = [{axis: float(x), **{f"{k}{s}": getattr(iv[k][g], a) for k in keys
                                         for s, a in (("", "mean"), ("_lo", "lo"), ("_hi", "hi"))}}
                     for g, x in enumerate(grid)]
    return out


def combine(runs: list, train_seeds: list) -> dict:
    """One method's runs (:func:`~flowrl.bench.training.run_variant` results, one per training seed, in
    ``train_seeds``' order) -> its row: the first run's ``recipe``, ``sampler``, ``loss``, ``real``; the seed
    means of ``iterations``, ``seconds_per_iteration``, ``samples_drawn`` and ``final_eval_reward``; ``final``
    (``{key: [mean, lo, hi]}`` at the end), ``mean_curves`` (:func:`mean_curves`) and ``runs`` (every seed's raw
    result, its ``train_seed`` added)."""
    keys = curve_keys([r["curve"] for r in runs])
    curves = mean_curves([r["curve"] for r in runs], keys)
    last = curves[AXES[0]][-1]  # every seed's final evaluation, held
    first = runs[0]
    return {"recipe": first["recipe"], "sampler": first["sampler"], "loss": first["loss"], "real": first["real"],
            "train_seeds": list(train_seeds),
            **{k: float(np.mean([r[k] for r in runs])) for k in ("iterations", "seconds_per_iteration",
                                                                  "samples_drawn")},
            "final_eval_reward": last["eval_reward"],  # the seed mean, as the times' target computes it
            "final": {k: [last[k], last[f"{k}_lo"], last[f"{k}_hi"]] for k in keys},
            "mean_curves": curves, "runs": [{"train_seed": s, **r} for s, r in zip(train_seeds, runs)]}


def _reward_grids(r: dict) -> dict:
    """A seeded row's eval reward per axis: ``{axis: (grid [G], values [N, G])}``."""
    curves, out = [run["curve"] for run in r["runs"]], {}
    for axis in AXES:
        grid, values = on_grid(curves, axis, ["eval_reward"])
        out[axis] = (grid, values["eval_reward"])
    return out


def add_intervals(res: dict, baseline: str) -> None:
    """When method ``baseline`` ran, every seeded row's time to the baseline's seed-mean final reward with intervals
    (:func:`~flowrl.bench.seeds.bootstrap_times`): ``baseline_final_above_base`` and per method
    ``seconds_to_baseline_final_reward`` / ``samples_to_baseline_final_reward`` / ``speedup_seconds`` /
    ``speedup_samples`` (the point estimate; None: never within the budget, or n/a), each with ``<key>_interval``
    ``[lo, hi]`` (None: never, at that end)."""
    if baseline not in res["variants"]:
        return
    got = bootstrap_times({name: _reward_grids(r) for name, r in res["variants"].items()}, baseline)
    res["baseline_final_above_base"] = got is not None
    for name, r in res["variants"].items():
        for axis, key in zip(AXES, ("seconds", "samples")):
            t = got[name][axis] if got else None
            s = got[name][f"speedup_{axis}"] if got else None
            reached = t is not None and math.isfinite(t.mean)
            r[f"{key}_to_baseline_final_reward"] = t.mean if reached else None
            r[f"{key}_to_baseline_final_reward_interval"] = [_finite(t.lo), _finite(t.hi)] if t else None
            r[f"speedup_{key}"] = s.mean if reached else None
            r[f"speedup_{key}_interval"] = [_finite(s.lo), _finite(s.hi)] if s else None


def num(v, fmt: str) -> str:
    """``v`` formatted by ``fmt``; ``-`` for None (never within the budget, or not measured)."""
    return "-" if v is None else format(v, fmt)


def cell(mean, interval, fmt: str) -> str:
    """``mean [lo, hi]`` (``-``: None, never within the budget)."""
    return f"{num(mean, fmt)} [{num(interval[0], fmt)}, {num(interval[1], fmt)}]" if interval else num(mean, fmt)


HEAD = (f"{'method':<12}{'recipe':>20}{'sampler':>8}{'s/iter':>8}{'samples':>9}{'final reward':>24}"
        f"{'diversity':>24}{'HF energy':>27}{'to GRPO s':>21}{'to GRPO samples':>23}{'x fewer samples':>21}")


def row(name: str, r: dict) -> str:
    """A seeded row of the table: seed means, ``mean [lo, hi]`` where the measure has an interval."""
    f = r["final"]
    return (f"{name:<12}{Path(r['recipe']).name:>20}{r['sampler']['name']:>8}{r['seconds_per_iteration']:>8.2f}"
            f"{r['samples_drawn']:>9.0f}{cell(f['eval_reward'][0], f['eval_reward'][1:], '.4f'):>24}"
            f"{cell(f['diversity'][0], f['diversity'][1:], '.4f'):>24}"
            f"{cell(f['hf_energy'][0], f['hf_energy'][1:], '.5f'):>27}"
            + "".join(f"{cell(r.get(k), r.get(f'{k}_interval'), fmt):>{w}}" for k, fmt, w in (
                ("seconds_to_baseline_final_reward", ".1f", 21), ("samples_to_baseline_final_reward", ".0f", 23),
                ("speedup_samples", ".2f", 21))))


def real_row(real: dict) -> str:
    """The real data's reward and watch values, under the seeded table's columns."""
    def cell(key, fmt, width):  # under the mean of ``mean [lo, hi]``
        v = format(real.get(key, float("nan")), fmt)
        return f"{v:<{len(v) * 3 + 5}}".rjust(width)
    return (f"{'real data':<12}{'':>20}{'':>8}{'':>8}{'':>9}{cell('reward', '.4f', 24)}{cell('diversity', '.4f', 24)}"
            f"{cell('hf_energy', '.5f', 27)}").rstrip()


def legend(res: dict) -> str:
    """What the seeded table's numbers are."""
    n, m = len(res["train_seeds"]), res.get("machine") or {}
    return (f"mean over {n} training seeds (train.seed {', '.join(map(str, res['train_seeds']))}) [95% bootstrap "
            f"interval over the seeds]; to GRPO s / samples: on the seed-mean curves, interval from the seeds "
            f"resampled ('-': never within the budget); measured on {m.get('cpu', 'an unnamed CPU')}, "
            f"{m.get('cpus')} cores")


def plot(res: dict, path: Path, baseline: str, more: Optional[Callable] = None) -> None:
    """The 2 x 2 picture of :data:`PANELS`: per method its seed-mean curve (steps) and the 95% interval shaded
    (the final point's as an error bar); ``more(ax)``: a fifth panel (the final reward per tag);
    dashed: the real data (black) and the baseline's seed-mean final reward (grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2 if more is None else 3, figsize=(10 if more is None else 15, 8), squeeze=False)
    real, base = res.get("real") or {}, res["variants"].get(baseline)
    for ax, ((xk, xl), (yk, yl)) in zip(axes.flat, PANELS):
        for name, r in res["variants"].items():
            c = r["mean_curves"][xk]
            x = [p[xk] for p in c]
            y, lo, hi = ([p[f"{yk}{s}"] for p in c] for s in ("", "_lo", "_hi"))
            line, = ax.step(x, y, where="post", label=name)
            ax.fill_between(x, lo, hi, step="post", alpha=0.2, color=line.get_color(), lw=0)
            ax.errorbar(x[-1:], y[-1:], yerr=[[y[-1] - lo[-1]], [hi[-1] - y[-1]]], fmt="o", ms=3, capsize=3,
                        color=line.get_color())  # the final point's interval (a step has no width there)
        reference_lines(ax, yk, real, base, f"{baseline} final (mean)")
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
    axes.flat[0].legend(fontsize=8)
    finish_extra_panels(axes, len(PANELS), more)
    fig.suptitle(f"every update on {res.get('pipeline', 'digits')}, {res['budget_seconds']:g} training s each, mean of "
                 f"{len(res['train_seeds'])} seeds (shaded: 95% interval)")
    save_figure(fig, path)
