"""Run outputs people look at: metrics.jsonl, image grids, curves."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..data.items import item_sources, item_texts
from ..utils.io import save_figure, write_text

__all__ = ["MetricsLog", "is_evaluation", "read_metrics", "reward_name", "plot_curves", "rollout_rows", "side_by_side"]


def rollout_rows(images: torch.Tensor, prompt_index: torch.Tensor, prompts: list, rows: int = 8,
                 cols: int = 8) -> tuple[torch.Tensor, int, list[str], list]:
    """A training grid of a rollout, a row per prompt: the first ``rows`` prompts that have samples (in
    sampling order), each with its first ``cols`` samples (every row as long as the shortest), labelled
    with the prompt's text and, for an edit, its source image(s) first.

    ``images`` ``[N, 3, (F,) H, W]``, ``prompt_index`` ``[N]`` into ``prompts`` -> (``[R * C, 3, (F,) H, W]``,
    ``C``, R labels, R sources (None or the item's sources))."""
    by_prompt: dict[int, list[int]] = {}
    for n, p in enumerate(prompt_index.tolist()):
        by_prompt.setdefault(int(p), []).append(n)
    chosen = list(by_prompt)[:rows]
    c = min(cols, *(len(by_prompt[p]) for p in chosen))
    take = torch.tensor([n for p in chosen for n in by_prompt[p][:c]], dtype=torch.long)
    items = [prompts[p] for p in chosen]
    return images[take], c, item_texts(items), item_sources(items)  # [R * C, 3, (F,) H, W]


def is_evaluation(record: dict) -> bool:
    """Whether a metrics record is an evaluation's (its keys ``eval/...``) rather than a unit's."""
    return any(k.startswith("eval/") for k in record)


class MetricsLog:
    """Append-only ``metrics.jsonl``; on resume from checkpoint ``resume_from``, the lines of the units
    redone are dropped: units ``>= resume_from`` and evaluations after it (the evaluation at
    ``resume_from`` itself came before its checkpoint and stays)."""

    def __init__(self, path: Path, resume_from: Optional[int] = None):
        self.path = path
        if resume_from is not None and path.exists():
            recs = [(ln, json.loads(ln)) for ln in path.read_text().splitlines() if ln.strip()]
            keep = [ln for ln, r in recs if r.get("iteration", -1) < resume_from
                    or (r.get("iteration") == resume_from and is_evaluation(r))]
            if len(keep) < len(recs):
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


def reward_name(weights: dict) -> str:
    """The trained reward in words: ``digits``, or ``0.7 x pickscore + 0.3 x ocr`` for a weighted sum."""
    if len(weights) == 1 and float(next(iter(weights.values()))) == 1.0:
        return str(next(iter(weights)))
    return " + ".join(f"{float(w):g} x {n}" for n, w in weights.items())


def plot_curves(records: Iterable[dict], path: Path, title: str = "") -> None:
    """Reward (train and eval; ``title`` names it) and the hacking watch (diversity, high-frequency
    energy vs real data), against whole iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
            ax.legend(fontsize=8)
        ax.set_xlabel("iteration"), ax.set_title(name)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole numbers
    save_figure(fig, path)


def side_by_side(before: Path, after: Path, out: Path, titles: tuple[str, str] = ("before", "after")) -> None:
    """Two PNGs next to each other, each under its title (e.g. ``before (iteration 0)``) -> ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image

    a, b = np.asarray(Image.open(before).convert("RGB")), np.asarray(Image.open(after).convert("RGB"))
    h, w = max(a.shape[0], b.shape[0]), a.shape[1] + b.shape[1]
    dpi = 100
    fig, axes = plt.subplots(1, 2, figsize=(max(4.0, w / dpi + 0.4), max(1.5, h / dpi + 0.5)), dpi=dpi,
                             gridspec_kw={"width_ratios": [a.shape[1], b.shape[1]]})
    for ax, img, title in zip(axes, (a, b), titles):
        ax.imshow(img, interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.axis("off")
    save_figure(fig, out, dpi=dpi)
