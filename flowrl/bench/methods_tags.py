"""``flowrl bench methods`` per tag: when the evaluation prompts carry tags (the shapes world's GenEval tags:
single_object, two_object, counting, colors, position, color_attr), each row's final evaluation reward per tag,
its table (text and markdown) and its picture panel.

A tag's value is the mean reward of the evaluation samples of its prompts (every seed of every prompt of the
tag) at a run's final evaluation (:func:`flowrl.builders.tag_means`); with several training seeds, the mean
over the seeds with its 95% bootstrap interval over them (:func:`flowrl.eval.stats.bootstrap_mean`, as every
seeded measure of the bench). A result without tags (digits) gains nothing.
"""
from __future__ import annotations

from ..eval.stats import bootstrap_mean
from .methods_seeds import _finite, cell


def _final_tags(r: dict) -> list[dict]:
    """Each training seed's final ``{tag: reward}`` of row ``r`` (one seed: its own; several: each run's)."""
    runs = r["runs"] if "runs" in r else [r]
    return [run["curve"][-1].get("tags") or {} for run in runs]


def add_tags(res: dict) -> None:
    """When the rows' evaluations carry tags: ``res["tags"]`` (the tags, in the evaluation's order) and per row
    ``final_tags``: ``{tag: reward}`` (one seed) or ``{tag: [mean, lo, hi]}`` (several: the seed mean, 95%
    interval over the seeds). Nothing changes for a result without tags."""
    tags = list(dict.fromkeys(t for r in res["variants"].values() for got in _final_tags(r) for t in got))
    if not tags:
        return
    res["tags"] = tags
    for r in res["variants"].values():
        finals = _final_tags(r)
        if "runs" not in r:
            r["final_tags"] = {t: _finite(finals[0][t]) for t in tags if t in finals[0]}
            continue
        out = {}
        for t in tags:
            iv = bootstrap_mean([f[t] for f in finals if t in f])
            out[t] = [_finite(iv.mean), _finite(iv.lo), _finite(iv.hi)]
        r["final_tags"] = out


def _cell(v, fmt: str) -> str:
    """A tag's value: ``v`` or ``mean [lo, hi]``."""
    return cell(v[0], v[1:], fmt) if isinstance(v, list) else cell(v, None, fmt)


def tag_table(res: dict) -> list[str]:
    """The text table of the final evaluation reward per tag: a row per method, the real data's last."""
    tags = res.get("tags") or []
    if not tags:
        return []
    width = max(12, *(len(t) + 2 for t in tags), 26 if len(res.get("train_seeds") or ()) > 1 else 0)
    rows = ["final eval reward per tag:", f"{'method':<12}" + "".join(f"{t:>{width}}" for t in tags)]
    for name, r in res["variants"].items():
        got = r.get("final_tags") or {}
        rows.append(f"{name:<12}" + "".join(f"{_cell(got.get(t), '.4f'):>{width}}" for t in tags))
    real = (res.get("real") or {}).get("tags") or {}
    if real:
        rows.append(f"{'real data':<12}" + "".join(f"{_cell(real.get(t), '.4f'):>{width}}" for t in tags))
    return rows


def tag_markdown(res: dict) -> list[str]:
    """The markdown table of the final evaluation reward per tag (``[]`` without tags)."""
    tags = res.get("tags") or []
    if not tags:
        return []
    rows = ["| method | " + " | ".join(tags) + " |", "|---" * (len(tags) + 1) + "|"]
    for name, r in res["variants"].items():
        got = r.get("final_tags") or {}
        rows.append(f"| {name} | " + " | ".join(_cell(got.get(t), ".3f") for t in tags) + " |")
    real = (res.get("real") or {}).get("tags") or {}
    if real:
        rows.append("| real data | " + " | ".join(_cell(real.get(t), ".3f") for t in tags) + " |")
    return rows


def _parts(v) -> tuple[float, float, float]:
    """A tag's value as ``(mean, lo, hi)`` floats (NaN for None; one seed: its value, no interval)."""
    nan = float("nan")
    if isinstance(v, list):
        return tuple(nan if x is None else float(x) for x in v)
    return (nan if v is None else float(v), nan, nan)


def plot_tags(ax, res: dict) -> None:
    """Grouped bars on ``ax``: per tag, each method's final evaluation reward (its 95% interval as an error bar
    with several seeds); the real data's value per tag as a black tick."""
    import numpy as np

    tags, names = res["tags"], list(res["variants"])
    x, width = np.arange(len(tags)), 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        got = res["variants"][name].get("final_tags") or {}
        parts = np.array([_parts(got.get(t)) for t in tags])  # [T, 3] mean, lo, hi (NaN: none)
        mean = parts[:, 0]
        err = np.nan_to_num(np.abs(parts[:, 1:] - mean[:, None])).T if np.isfinite(parts[:, 1:]).any() else None  # [2, T]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, mean, width, yerr=err, capsize=2, label=name)
    real = (res.get("real") or {}).get("tags") or {}
    if real:
        ax.scatter(x, [real.get(t, np.nan) for t in tags], marker="_", s=400, color="k", label="real data", zorder=3)
    ax.set_xticks(x)
    ax.set_xticklabels(tags, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final eval reward per tag")
    ax.set_title("per tag (colours as the curves; black: real data)", fontsize=9)
