"""Media helpers for video (flowrl.media): telling videos from images, per-frame reward averaging
equal to scoring the frames one by one, temporal consistency by hand, frame strips, and animations
read back from disk."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.data.digits import digits_dataset
from flowrl.media import (animation_formats, frame_strip, is_video, save_animation, score_per_frame,
                          video_frames)
from flowrl.rewards import build


def _videos(b=3, f=5, size=16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, 3, f, size, size, generator=g)  # [B, 3, F, H, W]


def test_is_video_and_frame_order():
    v = _videos(2, 4)
    assert is_video(v) and not is_video(v[:, :, 0])
    for bad in (torch.zeros(3, 8, 8), torch.zeros(2, 1, 4, 8, 8), [1, 2]):
        with pytest.raises(ValueError, match=r"images \[B, 3, H, W\] or videos \[B, 3, F, H, W\]"):
            is_video(bad)
    frames = video_frames(v, frame_stride=2)  # frames 0 and 2 of each video, video-major
    assert frames.shape == (4, 3, 16, 16)
    assert torch.equal(frames[1], v[0, :, 2]) and torch.equal(frames[2], v[1, :, 0])
    with pytest.raises(ValueError, match="frame_stride must be a positive integer"):
        video_frames(v, 0)


def _brightness(images, prompts, **meta):
    """A batch-independent reward: mean pixel value; NaN for prompts containing 'skip' and for
    frames darker than 0.3 (a frame-level 'cannot judge')."""
    out = images.mean(dim=(1, 2, 3))
    out[[("skip" in p) for p in prompts]] = float("nan")
    out[out < 0.3] = float("nan")
    return out


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_score_per_frame_equals_scoring_frames_one_by_one(stride):
    v = _videos(3, 7)
    v[1, :, 0] *= 0.2  # one dark frame: NaN for that frame only
    prompts = ["a", "b", "skip this one"]
    got = score_per_frame(_brightness, v, prompts, frame_stride=stride)
    for b in range(3):
        per_frame = torch.stack([_brightness(v[b, :, f][None].contiguous(), [prompts[b]])[0]
                                 for f in range(0, 7, stride)])
        want = per_frame[~per_frame.isnan()].mean() if not per_frame.isnan().all() else torch.tensor(float("nan"))
        torch.testing.assert_close(got[b], want, equal_nan=True, rtol=0, atol=0)  # bitwise
    assert got.dtype == torch.float32 and got[2].isnan() and torch.isfinite(got[:2]).all()
    images = v[:, :, 0]  # images are scored as they are
    torch.testing.assert_close(score_per_frame(_brightness, images, prompts), _brightness(images, prompts),
                               equal_nan=True, rtol=0, atol=0)


def test_score_per_frame_with_a_real_reward_and_per_row_meta():
    x, y = digits_dataset("test")  # [N, 1, 16, 16] in [-1, 1]
    frames = ((x[:12] + 1) / 2).expand(-1, 3, -1, -1)  # [12, 3, 16, 16]
    videos = frames.view(3, 4, 3, 16, 16).transpose(1, 2)  # [3, 3, 4, 16, 16]: 4 digits per video
    prompts = [f"a handwritten digit {int(y[4 * b])}" for b in range(3)]
    digits = build("digits")
    got = score_per_frame(digits, videos, prompts)
    want = torch.stack([torch.stack([digits(videos[b, :, f][None], [prompts[b]])[0] for f in range(4)]).mean()
                        for b in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # batched MLP vs one at a time: float rounding
    # per-row metadata (sources=) is repeated once per kept frame
    edit = build("digits_edit")
    sources = [videos[b, :, 0] for b in range(3)]
    got = score_per_frame(edit, videos, ["turn this into a 7"] * 3, frame_stride=2, sources=sources)
    want = torch.stack([torch.stack([edit(videos[b, :, f][None], ["turn this into a 7"], sources=[sources[b]])[0]
                                     for f in (0, 2)]).mean() for b in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="3 videos but 2 prompts"):
        score_per_frame(digits, videos, prompts[:2])
    with pytest.raises(ValueError, match=r"returned shape \(3,\) for 12 frames"):
        score_per_frame(lambda im, p, **m: torch.zeros(3), videos, prompts)


def test_temporal_consistency_by_hand():
    from flowrl.diagnostics import temporal_consistency

    still = _videos(2, 4)[:, :, :1].expand(-1, -1, 4, -1, -1)  # every frame the same
    assert temporal_consistency(still) == 1.0
    v = torch.zeros(1, 3, 3, 2, 2)
    v[:, :, 1] = 0.5  # frame differences: 0.5 then 0.5 -> mean 0.5
    assert temporal_consistency(v) == pytest.approx(0.5)
    v[:, 0, 2] = 0.5  # last frame: channel 0 stays at 0.5, channels 1 and 2 drop back to 0
    assert temporal_consistency(v) == pytest.approx(1 - (12 * 0.5 + 4 * 0.0 + 8 * 0.5) / 24)
    assert math.isnan(temporal_consistency(_videos(1, 1)))  # one frame: no pairs
    with pytest.raises(ValueError, match="expects videos"):
        temporal_consistency(torch.zeros(2, 3, 4, 4))


def test_frame_strip():
    v = _videos(2, 3, size=4)
    strip = frame_strip(v[0])  # [3, H, F * W]
    assert strip.shape == (3, 4, 12)
    for f in range(3):
        assert torch.equal(strip[:, :, 4 * f:4 * (f + 1)], v[0, :, f])
    batch = frame_strip(v, frame_stride=2)  # [B, 3, H, F' W], frames 0 and 2
    assert batch.shape == (2, 3, 4, 8) and torch.equal(batch[1, :, :, 4:], v[1, :, 2])
    with pytest.raises(ValueError, match="frame_strip expects a video"):
        frame_strip(torch.zeros(2, 3, 4, 4))


def test_save_animation_reads_back(tmp_path):
    levels = torch.tensor([0.0, 0.5, 1.0, 0.25])  # four flat frames, distinct greys
    video = levels.view(1, 4, 1, 1).expand(3, 4, 6, 5).clone()  # [3, F, H, W]
    video[0, 1] = 0.0  # frame 1 is cyan-ish: channels differ
    written = save_animation(video, tmp_path / "sample.png", fps=10, scale=2)
    assert [p.name for p in written] == [f"sample.{f}" for f in animation_formats()] and written[0].suffix == ".gif"
    assert not list(tmp_path.glob(".*tmp*"))  # atomic: no temporary file left
    want = (video.repeat_interleave(2, 2).repeat_interleave(2, 3).permute(1, 2, 3, 0) * 255).round()  # [F, H, W, 3]
    for path in written:
        with Image.open(path) as im:
            assert im.n_frames == 4 and im.size == (10, 12) and im.info.get("loop") == 0
            for f in range(4):
                im.seek(f)
                got = torch.tensor(np.array(im.convert("RGB")), dtype=torch.float32)  # [H, W, 3]
                tol = 0 if path.suffix == ".webp" else 2  # lossless WebP exact; GIF's palette of flat frames
                assert (got - want[f]).abs().max() <= tol, (path.name, f)
                assert im.info.get("duration") == 100
    with pytest.raises(ValueError, match="unknown animation format"):
        save_animation(video, tmp_path / "x", formats=("mp4",))
    with pytest.raises(ValueError, match=r"one video \[3, F, H, W\]"):
        save_animation(video[None], tmp_path / "x")


def test_trained_reward_path_scores_videos_per_frame_with_sources():
    """The trainer's path (``score_images`` on a ``MultiReward`` built with ``frame_stride``) on videos of
    editing items equals scoring each kept frame alone with its video's source, then averaging."""
    from flowrl.data import load_prompts
    from flowrl.rewards import build_multi
    from flowrl.scoring import score_images

    items = load_prompts("digits-edit-sample")[:3]
    videos = _videos(3, 5)  # [3, 3, 5, H, W]
    multi = build_multi({"digits_edit": 1.0, "jpeg_compressibility": 0.5}, {}, frame_stride=2)
    total, comps = score_images(multi, videos, items)
    edit, jpeg = build("digits_edit"), build("jpeg_compressibility")
    for b, it in enumerate(items):
        frames = [videos[b, :, f][None].contiguous() for f in (0, 2, 4)]
        want_edit = torch.stack([edit(fr, [it.prompt], sources=[it.image])[0] for fr in frames]).mean()
        want_jpeg = torch.stack([jpeg(fr, [it.prompt])[0] for fr in frames]).mean()
        torch.testing.assert_close(comps["digits_edit"][b], want_edit, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(comps["jpeg_compressibility"][b], want_jpeg, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(total).all()


def test_to_uint8_and_to_pil_hold_what_an_8_bit_file_would():
    """The one float -> 8-bit conversion (rewards' PIL inputs, the wire format, OCR, the edit pipeline's sources):
    clamped to [0, 1], then round(255 x)."""
    from flowrl.utils.images import to_pil, to_uint8

    x = torch.tensor([-0.5, 0.4 / 255, 1.6 / 255, 0.25, 1.0, 2.0])
    assert to_uint8(x).tolist() == [0, 0, 2, 64, 255, 255]
    image = torch.rand(3, 4, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)  # [3, H, W]
    pil = to_pil(image)
    assert pil.mode == "RGB" and pil.size == (6, 4)
    assert np.array_equal(np.asarray(pil), to_uint8(image).permute(1, 2, 0).numpy())  # [H, W, 3]
