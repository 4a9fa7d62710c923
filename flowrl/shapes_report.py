"""``flowrl pretrain-shapes``'s sample report: how well the shapes base draws each GenEval tag.

Application layer (see ``flowrl.layers``): it combines the shapes model, the GenEval reward on the
shapes detector and the ODE sampler, so it lives above all three.

Samples of the held-out prompts (unseen combinations of seen words), a fixed number per tag, at each
guidance scale; the score per tag is GenEval's official verdict and Flow-GRPO's partial score under
GenEval's rules, read by the shapes detector (``flowrl.rewards.shapes_detector``); without that
detector in this build, pixel-level checks (the share of pixels near a palette colour or the
background, and whether each colour a prompt names is drawn). Cached beside the model like the
digits report (:func:`flowrl.digits_report.cached_report`).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from .data.shapes import BACKGROUND, PALETTE, shapes_rows
from .digits_report import cached_report as cached
from .digits_report import guidance_grid_report
from .pipelines.shapes import ShapesPolicy

PER_TAG, NUM_STEPS = 16, 20  # the report's samples per tag and ODE steps
GUIDANCES = (1.0, 3.0)
DETECTOR = {"detector": "flowrl.rewards.shapes_detector:ShapesDetector",
            "colors": "flowrl.rewards.shapes_detector:PaletteColors", "metadata": "shapes"}
NEAR = 60.0  # 8-bit RGB distance within which a pixel counts as a palette (or background) colour


def heldout_rows(per_tag: int) -> list[dict]:
    """``per_tag`` held-out rows per GenEval tag (cycling through the tag's held-out prompts), tag by tag."""
    rows = shapes_rows("heldout")
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    by_tag = {t: [r for r in rows if r["tag"] == t] for t in tags}
    return [by_tag[t][i % len(by_tag[t])] for t in tags for i in range(per_tag)]


def geneval_scorers() -> Optional[dict]:
    """GenEval's official verdict and Flow-GRPO's partial score on the shapes detector, or None when this
    build has no shapes detector."""
    try:
        import flowrl.rewards.shapes_detector  # noqa: F401
    except ImportError:
        return None
    from .rewards import build

    return {score: build("geneval", **DETECTOR, score=score) for score in ("official", "partial")}


def pixel_checks(images: torch.Tensor, rows: list[dict]) -> dict[str, np.ndarray]:
    """Per image: ``clean``, the share of pixels within :data:`NEAR` of a palette colour or the
    background; ``colors_drawn``, 1 when every colour the row names covers at least 8 pixels (NaN for a
    row that names none). images [B, 3, S, S] in [0, 1]."""
    px = (images.permute(0, 2, 3, 1).float() * 255).numpy()  # [B, S, S, 3]
    refs = {**PALETTE, "background": BACKGROUND}
    dist = {k: np.linalg.norm(px - np.array(v, np.float32), axis=-1) for k, v in refs.items()}  # [B, S, S] each
    clean = (np.min(np.stack(list(dist.values())), axis=0) < NEAR).mean(axis=(1, 2))  # [B]
    drawn = np.full(len(rows), np.nan)
    for i, r in enumerate(rows):
        named = [c["color"] for c in r["include"] if "color" in c]
        if named:
            drawn[i] = float(all((dist[c][i] < NEAR).sum() >= 8 for c in named))
    return {"clean": clean, "colors_drawn": drawn}


def _mean(values) -> float:
    """The mean of the values that are not NaN (NaN when none is)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(v.mean()) if len(v) else float("nan")


def _per_tag(values: np.ndarray, rows: list[dict]) -> dict[str, float]:
    """Per GenEval tag, the mean of ``values`` [B] over its rows; ``mean``: the mean over the tags."""
    tags = [r["tag"] for r in rows]
    out = {t: _mean(values[[i for i, x in enumerate(tags) if x == t]]) for t in dict.fromkeys(tags)}
    out["mean"] = _mean(list(out.values()))
    return out


@torch.no_grad()
def score_samples(images: torch.Tensor, rows: list[dict], scorers: Optional[dict]) -> dict:
    """Per tag (and their mean): GenEval's verdict and partial score with ``scorers``, else the pixel checks."""
    prompts = [r["prompt"] for r in rows]
    if scorers is None:
        return {k: _per_tag(v, rows) for k, v in pixel_checks(images, rows).items()}
    return {k: _per_tag(s(images, prompts, metadata=rows).numpy(), rows) for k, s in scorers.items()}


def sample_grid_report(path: str | os.PathLike, grid_png: str | os.PathLike, per_tag: int = PER_TAG,
                       num_steps: int = NUM_STEPS, guidances: tuple[float, ...] = GUIDANCES) -> dict:
    """Sample the held-out prompts (``per_tag`` per tag) at each guidance scale (ODE, fixed seeds), save
    one grid PNG (a block per guidance, a row per tag) and return the scores per tag."""
    rows = heldout_rows(per_tag)
    scorers = geneval_scorers()
    report = guidance_grid_report(ShapesPolicy, path, grid_png, [r["prompt"] for r in rows], per_tag, num_steps,
                                  guidances, lambda images: score_samples(images, rows, scorers), scale=2)
    return {**report, "scored_by": "geneval rules on the shapes detector" if scorers else "pixel checks"}


def cached_report(model_dir: str | os.PathLike, force: bool = False) -> dict:
    """:func:`sample_grid_report` of the shapes base in ``model_dir`` (grid ``model_dir/samples.png``), cached
    in ``model_dir/report.json`` while its ``pretrain.json`` is unchanged (:func:`flowrl.digits_report.cached_report`)."""
    return cached(model_dir, force, measure=sample_grid_report)
