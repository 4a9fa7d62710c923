"""Run outputs people look at: metrics.jsonl, image grids, curves."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from ..utils.io import save_figure, save_png, write_text

__all__ = ["MetricsLog", "read_metrics", "plot_curves", "side_by_side"]


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, lines from the redone iterations are dropped."""

    def __init__(self, path: Path, resume_from: Optional[int] = None):
        self.path = path
        if resume_from is not None and path.exists():
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("iteration", -1) < resume_from]
            write_text(path, "".join(k + "\n" for k in keep))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        return read_metrics(self.path)


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def plot_curves(records: Iterable[dict], path: Path, title: str = "") -> None:
    """Reward (train and eval) and the hacking watch (diversity, high-frequency energy vs real data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = list(records)
    train = [r for r in recs if "reward_mean" in r]
    ev = [r for r in recs if "eval/reward" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    if train:
        it = [r["iteration"] for r in train]
        ax.plot(it, [r["reward_mean"] for r in train], alpha=0.7, label="train reward (SDE rollouts, batch mean)")
    if ev:
        ax.plot([r["iteration"] for r in ev], [r["eval/reward"] for r in ev], "o-", label="eval reward (ODE, fixed seeds)")
    real_r = next((r["real/reward"] for r in recs if "real/reward" in r), None)
    if real_r is not None:
        ax.axhline(real_r, color="k", ls="--", label="real data")
    ax.set_xlabel("iteration"), ax.set_ylabel("reward"), ax.legend(fontsize=8), ax.set_title(title or "reward")
    for ax, key, name in ((axes[1], "eval/diversity", "within-prompt diversity"),
                          (axes[2], "eval/hf_energy", "high-frequency energy")):
        pts = [r for r in ev if key in r]
        if pts:
            ax.plot([r["iteration"] for r in pts], [r[key] for r in pts], "o-", label="policy")
            real = next((r[key.replace("eval/", "real/")] for r in recs if key.replace("eval/", "real/") in r), None)
            if real is not None:
                ax.axhline(real, color="k", ls="--", label="real data")
        ax.set_xlabel("iteration"), ax.set_title(name), ax.legend(fontsize=8)
    save_figure(fig, path)


def side_by_side(before: Path, after: Path, out: Path) -> None:
    """Two PNGs next to each other (white gap) -> ``out``."""
    import numpy as np
    from PIL import Image

    a, b = np.asarray(Image.open(before).convert("RGB")), np.asarray(Image.open(after).convert("RGB"))
    h = max(a.shape[0], b.shape[0])
    pad = lambda x: np.pad(x, ((0, h - x.shape[0]), (0, 0), (0, 0)), constant_values=255)  # noqa: E731
    gap = np.full((h, 12, 3), 255, np.uint8)
    save_png(np.concatenate([pad(a), gap, pad(b)], axis=1), out)
