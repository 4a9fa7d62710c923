"""Reward-hacking watch: measures a trained reward cannot see. Pure functions on images ``[N, C, H, W]``
or videos ``[N, C, F, H, W]`` in [0, 1]; :func:`watch` gives all that apply to a batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def within_group_diversity(images: torch.Tensor, groups: torch.Tensor) -> float:
    """Mean pairwise RMS distance between images of the same group (prompt), averaged over groups.

    ``images`` [N, C, H, W] (or videos [N, C, F, H, W]: the RMS over whole videos) in [0, 1],
    ``groups`` [N]. Units: RMS pixel difference (0..1). Mode collapse shows as a falling value.
    """
    flat = images.float().flatten(1)  # [N, D]
    vals = []
    for g in torch.unique(groups):
        x = flat[groups == g]
        if x.shape[0] < 2:
            continue
        d = torch.cdist(x, x) / x.shape[1] ** 0.5  # [n, n] RMS distance
        n = x.shape[0]
        vals.append(d.sum() / (n * (n - 1)))
    return float(torch.stack(vals).mean()) if vals else float("nan")


def high_frequency_energy(images: torch.Tensor, factor: int = 2) -> float:
    """Mean squared residual after ``factor`` x ``factor`` average pooling and nearest upsampling.

    The energy a reward that looks at a ``factor``-times downsampled view cannot see (2-pixel
    checkerboards, grid artifacts). ``images`` [N, C, H, W] in [0, 1], or videos [N, C, F, H, W] (every
    frame counted); units: pixel value^2.
    """
    x = images.float()
    if x.ndim == 5:
        x = x.transpose(1, 2).flatten(0, 1)  # [N * F, C, H, W]
    low = F.interpolate(F.avg_pool2d(x, factor), scale_factor=factor, mode="nearest")  # [N, C, H, W]
    return float(((x - low) ** 2).mean())


def temporal_consistency(videos: torch.Tensor) -> float:
    """``1 - mean |x[f + 1] - x[f]|``: one minus the mean absolute difference between consecutive
    frames, over videos, channels, frame pairs and pixels. Units: pixel values in [0, 1], so the
    result is in [0, 1]; 1 = every frame equals the one before (a frozen video).

    Reward-hacking watch, beside within-group diversity and high-frequency energy: a falling value
    means flicker or frame-to-frame noise; a value rising towards 1 means the videos stop moving.
    NaN for videos of a single frame (no pairs)."""
    if videos.ndim != 5:
        raise ValueError(f"temporal_consistency expects videos [B, 3, F, H, W], got images {tuple(videos.shape)}")
    x = videos.float()
    if x.shape[2] < 2:
        return float("nan")
    return 1.0 - float((x[:, :, 1:] - x[:, :, :-1]).abs().mean())


def watch(images: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """The watch's measures of one batch: ``diversity`` (:func:`within_group_diversity`), ``hf_energy``
    (:func:`high_frequency_energy`) and, for videos, ``temporal_consistency``."""
    met = {"diversity": within_group_diversity(images, groups), "hf_energy": high_frequency_energy(images)}
    if images.ndim == 5:
        met["temporal_consistency"] = temporal_consistency(images)
    return met
