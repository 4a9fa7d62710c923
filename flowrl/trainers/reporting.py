"""Run outputs people look at: metrics.jsonl, image grids, curves."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch


def image_grid(images: torch.Tensor, nrow: int, pad: int = 1, scale: int = 1) -> np.ndarray:
    """``[N, 3, H, W]`` in [0, 1] -> ``[rows*(H+pad), nrow*(W+pad), 3]`` uint8 (``scale``x nearest)."""
    x = images.detach().float().clamp(0, 1).cpu()
    if scale > 1:
        x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3)
    n, c, h, w = x.shape
    rows = math.ceil(n / nrow)
    grid = torch.ones(c, rows * (h + pad) + pad, nrow * (w + pad) + pad) * 0.5
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + col * (w + pad): pad + col * (w + pad) + w] = x[i]
    return (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def save_png(array: np.ndarray, path: Path) -> None:
    """Write a PNG atomically (temporary name, then rename)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    Image.fromarray(array).save(tmp, format="PNG")
    os.replace(tmp, path)


def save_grid(images: torch.Tensor, path: Path, nrow: int, scale: int = 1) -> None:
    save_png(image_grid(images, nrow, scale=scale), path)


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume, lines from the redone iterations are dropped."""

    def __init__(self, path: Path, resume_from: Optional[int] = None):
        self.path = path
        if resume_from is not None and path.exists():
            keep = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("iteration", -1) < resume_from]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(k + "\n" for k in keep))
            os.replace(tmp, path)

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


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, write a matplotlib figure as PNG atomically (temporary name, then rename), close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)


def write_json(obj, path: Path) -> None:
    """Write ``obj`` as indented JSON atomically (temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
