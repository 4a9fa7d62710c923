"""``flowrl bench ocr``: the OCR engines side by side on the same rendered images.

The targets are the quoted texts of Flow-GRPO's OCR test prompts (``flowgrpo-ocr-test``, in order);
each is drawn with Pillow's bundled FreeType font at a seeded random size, colour and position, on
a plain background or a photo (scikit-learn's bundled sample images), rotated a few degrees, with
a little blur and noise on some: text as a generated image shows it, nothing downloaded. Every
engine reads the same images through the ``ocr`` reward; the table gives the mean reward (``1 -
normalised edit distance``), the share read exactly (reward 1) and seconds per image after one
warm-up image, wall-clock and CPU time of the process and its children (on a shared machine the CPU time is the
fairer measure; one thread unless ``--threads``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import BenchError

BACKENDS = ("rapidocr", "easyocr", "tesseract")


def _background(rng: np.random.Generator, size: int, photos: list):
    from PIL import Image

    if rng.random() < 0.5:
        return Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(150, 256, 3)))
    photo = photos[int(rng.integers(len(photos)))]
    y, x = rng.integers(0, photo.shape[0] - 200), rng.integers(0, photo.shape[1] - 200)
    return Image.fromarray(photo[y:y + 200, x:x + 200]).resize((size, size), Image.BICUBIC)


def render_case(text: str, rng: np.random.Generator, size: int, photos: list):
    """One image of ``text`` (module doc) as a PIL RGB image."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    im = _background(rng, size, photos)
    font = ImageFont.load_default(size=int(rng.integers(size // 14, size // 8)))
    d = ImageDraw.Draw(im)
    while d.textbbox((0, 0), text, font=font)[2] > size * 0.75 and font.size > 8:
        font = ImageFont.load_default(size=font.size - 2)
    left, top, right, bottom = d.textbbox((0, 0), text, font=font)
    m = size * 0.1  # margin: the rotation keeps the text inside the image
    x = rng.uniform(m, max(size - (right - left) - m, m + 1)) - left
    y = rng.uniform(m, max(size - (bottom - top) - m, m + 1)) - top
    d.rectangle((x + left - 6, y + top - 6, x + right + 6, y + bottom + 6),
                fill=tuple(int(v) for v in rng.integers(200, 256, 3)))
    d.text((x, y), text, fill=tuple(int(v) for v in rng.integers(0, 80, 3)), font=font)
    im = im.rotate(float(rng.uniform(-8, 8)), resample=Image.BICUBIC, fillcolor=(128, 128, 128))
    if rng.random() < 0.3:
        im = im.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 1.2))))
    a = np.asarray(im, dtype=np.float32)
    if rng.random() < 0.3:
        a = a + rng.normal(0, 8, a.shape)
    return np.clip(a, 0, 255).astype(np.uint8)


def cases(n: int, size: int, seed: int = 0) -> tuple[torch.Tensor, list[str]]:
    """``n`` rendered images ``[n, 3, size, size]`` in [0, 1] and their prompts (module doc)."""
    from sklearn.datasets import load_sample_images

    from flowrl.data import load_prompts
    from flowrl.rewards.ocr import quoted_text

    prompts = [p for p in load_prompts("flowgrpo-ocr-test") if quoted_text(p)][:n]
    rng = np.random.default_rng(seed)
    photos = list(load_sample_images().images)
    pixels = np.stack([render_case(quoted_text(p), rng, size, photos) for p in prompts])  # [n, S, S, 3]
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255, prompts


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (tesseract runs as a child process)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def bench_ocr(a) -> dict:
    """Every backend of ``--backends`` on the same ``--images`` rendered images."""
    from flowrl.rewards import build
    from flowrl.utils.io import write_json

    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise BenchError(f"unknown OCR backend(s) {unknown}; choose among {', '.join(BACKENDS)}")
    images, prompts = cases(a.images, a.size, a.seed)
    torch.set_num_threads(a.threads)
    rows = {}
    for b in backends:
        reward = build("ocr", backend=b)
        reward(images[:1], prompts[:1])  # warm-up: sessions and weights load lazily
        t0, c0 = time.perf_counter(), _cpu_seconds()
        s = reward(images, prompts)
        seconds, cpu = (time.perf_counter() - t0) / len(prompts), (_cpu_seconds() - c0) / len(prompts)
        rows[b] = {"mean_reward": float(s.mean()), "exact": float((s == 1).float().mean()),
                   "seconds_per_image": seconds, "cpu_seconds_per_image": cpu,
                   "scores": [round(float(v), 4) for v in s]}
        print(f"[flowrl] {b}: mean reward {rows[b]['mean_reward']:.3f}, exact {rows[b]['exact']:.0%}, "
              f"{seconds:.3f} s/image ({cpu:.3f} CPU s/image)", flush=True)
    out = {"images": len(prompts), "size": a.size, "seed": a.seed, "threads": a.threads, "backends": rows}
    if a.out:
        write_json(out, Path(a.out) / "ocr.json")
    return out


def table(out: dict) -> str:
    lines = [f"OCR engines on {out['images']} rendered images of {out['size']} px ({out['threads']} thread(s))",
             f"{'backend':<10} {'mean reward':>11} {'exact':>6} {'s/image':>8} {'CPU s/image':>11}"]
    for b, r in out["backends"].items():
        lines.append(f"{b:<10} {r['mean_reward']:>11.3f} {r['exact']:>6.0%} {r['seconds_per_image']:>8.3f} "
                     f"{r['cpu_seconds_per_image']:>11.3f}")
    return "\n".join(lines)


def add_ocr_parser(bench_sub) -> None:
    p = bench_sub.add_parser("ocr", help="OCR engines side by side on the same rendered images (accuracy, speed)")
    p.add_argument("--images", type=int, default=100, help="rendered images (targets of flowgrpo-ocr-test, in order)")
    p.add_argument("--size", type=int, default=512, help="image side in pixels")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated OCR backends")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch and onnxruntime)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for ocr.json (default: none written)")
    p.set_defaults(fn=lambda a: table(bench_ocr(a)))
