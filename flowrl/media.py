"""Media beyond images: videos ``[B, 3, F, H, W]`` (channels before frames, as flowrl's video
policies decode them) beside images ``[B, 3, H, W]``, values in [0, 1].

Pure functions: telling the two apart, scoring a video with any image reward frame by frame, and
writing a video as an animation or a
frame strip (atomically, through ``flowrl.utils.io``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .utils.io import atomic_write

ANIMATION_FORMATS = ("gif", "webp")
ScoreOut = Union[torch.Tensor, Mapping[str, torch.Tensor]]  # a reward's [n], or MultiReward.components' name -> [n]

__all__ = ["is_video", "video_frames", "score_per_frame", "frame_strip", "save_animation",
           "animation_formats", "ANIMATION_FORMATS", "save_samples"]


def is_video(x: torch.Tensor) -> bool:
    """True for a video batch ``[B, 3, F, H, W]``, False for an image batch ``[B, 3, H, W]``; any
    other shape is an error."""
    if not isinstance(x, torch.Tensor) or x.ndim not in (4, 5) or x.shape[1] != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expected images [B, 3, H, W] or videos [B, 3, F, H, W], got {shape}")
    return x.ndim == 5


def _check_stride(frame_stride: int) -> None:
    if not isinstance(frame_stride, int) or isinstance(frame_stride, bool) or frame_stride < 1:
        raise ValueError(f"frame_stride must be a positive integer, got {frame_stride!r}")


def video_frames(videos: torch.Tensor, frame_stride: int = 1) -> torch.Tensor:
    """The frames kept (``0, s, 2s, ...`` for ``s = frame_stride``) as one image batch
    ``[B * F', 3, H, W]``, video-major: video 0's kept frames first, then video 1's, ..."""
    if not is_video(videos):
        raise ValueError(f"video_frames expects videos [B, 3, F, H, W], got images {tuple(videos.shape)}")
    _check_stride(frame_stride)
    kept = videos[:, :, ::frame_stride]  # [B, 3, F', H, W]
    return kept.transpose(1, 2).flatten(0, 1)  # [B * F', 3, H, W]


def _repeat_rows(value, n: int, k: int):
    """A per-row metadata value (a sequence or tensor of length ``n``) repeated ``k`` times per row;
    anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n:
        return value.repeat_interleave(k, dim=0)
    if isinstance(value, (list, tuple)) and len(value) == n:
        return [v for v in value for _ in range(k)]
    return value


def score_per_frame(reward_fn: Callable[..., ScoreOut], videos: torch.Tensor, prompts: Sequence[str],
                    frame_stride: int = 1, **meta) -> ScoreOut:
    """Score videos with an image reward: every ``frame_stride``-th frame of every video in one image
    batch, then the mean over each video's kept frames -> float32 ``[B]``. flowrl reduces frames here
    and nowhere else (``flowrl.scoring.score_images`` calls it for every reward).

    ``reward_fn`` returns scores ``[n]`` or a mapping ``name -> [n]`` (``MultiReward.components``);
    a mapping is reduced per entry (-> ``name -> [B]``). Images ``[B, 3, H, W]`` are scored as they
    are (``reward_fn(images, prompts, **meta)``), so callers need not branch. ``prompts`` and every
    per-row ``meta`` value (a list, tuple or tensor of length B, e.g. ``sources=``) are repeated once
    per kept frame; other ``meta`` values pass unchanged.

    NaN: a frame scored NaN (not applicable, or the reward could not judge it) is left out of its
    video's mean; a video is NaN only when all its kept frames are. For a reward whose NaN depends
    on the prompt alone (every frame of the video NaN) this is the reward's own NaN.
    """
    if not is_video(videos):
        out = reward_fn(videos, list(prompts), **meta)
        return out if isinstance(out, Mapping) else torch.as_tensor(out).float().cpu()
    b = videos.shape[0]
    if len(prompts) != b:
        raise ValueError(f"score_per_frame got {b} videos but {len(prompts)} prompts")
    frames = video_frames(videos, frame_stride)  # [B * F', 3, H, W]
    k = frames.shape[0] // b
    frame_prompts = [p for p in prompts for _ in range(k)]
    frame_meta = {name: _repeat_rows(v, b, k) for name, v in meta.items()}
    out = reward_fn(frames, frame_prompts, **frame_meta)  # [B * F'] (or name -> [B * F'])
    if isinstance(out, Mapping):
        return {name: _video_means(v, b, k) for name, v in out.items()}  # name -> [B]
    return _video_means(out, b, k)  # [B]


def _video_means(scores, b: int, k: int) -> torch.Tensor:
    """Per-frame scores ``[B * F']`` (video-major) -> the NaN-aware mean per video, float32 ``[B]``."""
    scores = torch.as_tensor(scores).float().cpu()  # [B * F']
    if scores.shape != (b * k,):
        raise ValueError(f"the reward returned shape {tuple(scores.shape)} for {b * k} frames; a reward returns "
                         f"one float per image, shape [{b * k}]")
    return scores.view(b, k).nanmean(dim=1)  # [B]


def frame_strip(video: torch.Tensor, frame_stride: int = 1, gap: int = 0, gap_value: float = 1.0) -> torch.Tensor:
    """The kept frames side by side: ``[3, F, H, W]`` -> ``[3, H, F' W]`` (one video), or
    ``[B, 3, F, H, W]`` -> ``[B, 3, H, F' W]`` (a batch, ready for ``flowrl.utils.images.image_grid``);
    ``gap`` columns of ``gap_value`` between frames make the width ``F' W + (F' - 1) gap``."""
    _check_stride(frame_stride)
    if video.ndim == 4 and video.shape[0] == 3:
        return frame_strip(video[None], frame_stride, gap, gap_value)[0]
    if not is_video(video):
        raise ValueError(f"frame_strip expects a video [3, F, H, W] or videos [B, 3, F, H, W], "
                         f"got {tuple(video.shape)}")
    x = video[:, :, ::frame_stride]  # [B, 3, F', H, W]
    if gap:
        x = torch.cat([x, torch.full((*x.shape[:4], gap), gap_value, dtype=x.dtype)], dim=4)  # [B, 3, F', H, W+g]
    b, c, f, h, w = x.shape
    strip = x.permute(0, 1, 3, 2, 4).reshape(b, c, h, f * w)  # [B, 3, H, F' (W + g)]
    return strip[..., :f * w - gap] if gap else strip


def animation_formats() -> tuple[str, ...]:
    """The formats of :data:`ANIMATION_FORMATS` this PIL build writes as animations: GIF always;
    WebP when PIL has libwebp (Pillow < 11 also needs its separate ``webp_anim`` feature)."""
    from PIL import features

    webp = features.check_module("webp") and ("webp_anim" not in features.features
                                              or bool(features.check_feature("webp_anim")))
    return ("gif", "webp") if webp else ("gif",)


def _uint8_frames(video: torch.Tensor, scale: int) -> list:
    from PIL import Image

    if not (video.ndim == 4 and video.shape[0] == 3):
        raise ValueError(f"save_animation expects one video [3, F, H, W] in [0, 1], got {tuple(video.shape)}")
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a positive integer, got {scale!r}")
    x = video.detach().float().clamp(0, 1).cpu()  # [3, F, H, W]
    if scale > 1:
        x = x.repeat_interleave(scale, 2).repeat_interleave(scale, 3)  # [3, F, H s, W s]
    arr = (x.permute(1, 2, 3, 0).numpy() * 255).round().astype(np.uint8)  # [F, H, W, 3]
    return [Image.fromarray(frame) for frame in arr]


def save_animation(video: torch.Tensor, path: Union[str, os.PathLike], fps: float = 8.0, scale: int = 1,
                   formats: Sequence[str] = ANIMATION_FORMATS) -> list[Path]:
    """Write one video ``[3, F, H, W]`` in [0, 1] as looping animations, each file atomically:
    ``path`` with its suffix replaced by ``.gif`` (always) and ``.webp`` (when this PIL build writes
    animated WebP, :func:`animation_formats`; lossless). ``fps``: frames per second (GIF stores
    frame times in 10 ms units); ``scale``: nearest-neighbour upsampling for tiny videos. Returns
    the paths written."""
    bad = set(formats) - set(ANIMATION_FORMATS)
    if bad:
        raise ValueError(f"unknown animation format(s) {sorted(bad)}; choose from {list(ANIMATION_FORMATS)}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    frames = _uint8_frames(video, scale)
    duration = max(1, round(1000.0 / fps))  # ms per frame
    supported = animation_formats()
    written = []
    for fmt in (f for f in formats if f in supported):
        options = {"optimize": False} if fmt == "gif" else {"lossless": True}
        out = Path(path).with_suffix(f".{fmt}")
        atomic_write(out, lambda tmp, fmt=fmt, options=options: frames[0].save(
            tmp, format=fmt.upper(), save_all=True, append_images=frames[1:], duration=duration, loop=0, **options))
        written.append(out)
    return written


VIDEO_PAD, VIDEO_BACKGROUND = 4, 0.2  # between the videos of a grid: 4 dark pixels (their frames: 1 white)


def save_samples(samples: torch.Tensor, path: Union[str, os.PathLike], nrow: int, scale: int = 1,
                 fps: float = 8.0, labels: Optional[Sequence[str]] = None, sources=None) -> list[Path]:
    """Save a batch of samples for people to look at: images ``[N, 3, H, W]`` as one PNG grid at
    ``path``; videos ``[N, 3, F, H, W]`` as a PNG grid of frame strips (:func:`frame_strip`, frames 1 px
    apart, videos :data:`VIDEO_PAD` px apart on a dark ground) at ``path`` and beside it the grid animated
    over the frames (:func:`save_animation`: ``.gif``, ``.webp``). Grid rows hold ``nrow`` samples (fewer
    when there are fewer: no empty canvas); ``labels`` captions each row (its prompt or instruction) and
    ``sources`` puts each row's source image(s) before it (an edit's inputs: None, a tensor, or a list
    per row; no column when every row has None), as :func:`flowrl.utils.images.labeled_grid`. Returns
    the paths written."""
    from .utils.images import labeled_grid
    from .utils.io import save_png

    if not is_video(samples):
        save_png(labeled_grid(samples, nrow, scale, labels, sources), path)
        return [Path(path)]
    size = tuple(samples.shape[-2:])
    grid = labeled_grid(frame_strip(samples, gap=1), nrow, scale, labels, sources, pad=VIDEO_PAD,
                        background=VIDEO_BACKGROUND, source_size=size)
    save_png(grid, path)
    frames = [torch.from_numpy(labeled_grid(samples[:, :, f], nrow, scale, labels, sources, pad=VIDEO_PAD,
                                            background=VIDEO_BACKGROUND)).permute(2, 0, 1).float() / 255
              for f in range(samples.shape[2])]  # F x [3, H', W']
    return [Path(path), *save_animation(torch.stack(frames, 1), Path(path).with_name(Path(path).stem + "_anim"), fps)]
