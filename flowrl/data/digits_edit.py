"""The shipped editing sample set: scikit-learn's bundled digits as source images, with instructions.

``flowrl/data/prompt_sets/digits_edit_sample.jsonl`` and the PNGs in ``prompt_sets/digits_edit/``
are exactly what :func:`write_digits_edit_set` writes (a test checks it), so they install with
flowrl and need no download. Sources: for each digit 0-9, the first image of that digit in the
digits' test split (``flowrl.data.digits.digits_dataset("test")``), at the digits model's 16 x 16
(bilinear from the 8 x 8 originals), bright strokes on black as the digits model draws them,
saved as 8-bit greyscale PNGs. Instructions:

* one change per source, ``"turn this A into a B"`` with B a digit drawn alike (1 <-> 7, 3 <-> 8, ...);
* four stroke edits on the same sources, ``"make the strokes of this A thicker"`` / ``thinner``.

Each row has ``prompt`` (the instruction), ``image`` (path relative to the ``.jsonl``), and
``source_digit`` / ``target_digit`` for readers that want the labels (the ``digits_edit`` reward
parses the instruction itself). Regenerate with ``write_digits_edit_set(SETS_DIR)``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

import torch

from ..utils.io import save_png, write_text
from .digits import digits_dataset

SAMPLE_FILE = "digits_edit_sample.jsonl"
IMAGE_DIR = "digits_edit"
# change edits: each digit into one drawn alike
CHANGE_TO = {0: 8, 1: 7, 2: 3, 3: 8, 4: 9, 5: 6, 6: 5, 7: 1, 8: 3, 9: 4}
# stroke edits: (digit, "thicker" | "thinner")
STROKE_EDITS = ((0, "thicker"), (4, "thicker"), (1, "thicker"), (8, "thinner"))

__all__ = ["SAMPLE_FILE", "IMAGE_DIR", "CHANGE_TO", "STROKE_EDITS", "source_digits", "digits_edit_rows",
           "write_digits_edit_set"]


def source_digits() -> dict[int, torch.Tensor]:
    """Digit -> its source image as uint8 ``[16, 16]`` (the first test-split image of that digit)."""
    x, y = digits_dataset("test")  # [N, 1, 16, 16] in [-1, 1], [N]
    out = {}
    for d in range(10):
        i = int((y == d).nonzero()[0])
        out[d] = ((x[i, 0] + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8)  # [16, 16]
    return out


def digits_edit_rows() -> list[dict]:
    """The sample set's rows, in file order (module doc)."""
    image = lambda d: f"{IMAGE_DIR}/digit_{d}.png"  # noqa: E731
    article = lambda t: "an" if t == 8 else "a"  # noqa: E731
    rows = [{"prompt": f"turn this {d} into {article(t)} {t}", "image": image(d), "source_digit": d,
             "target_digit": t} for d, t in CHANGE_TO.items()]
    rows += [{"prompt": f"make the strokes of this {d} {how}", "image": image(d), "source_digit": d, "target_digit": d}
             for d, how in STROKE_EDITS]
    return rows


def write_digits_edit_set(out_dir: Union[str, os.PathLike]) -> Path:
    """Write ``digits_edit_sample.jsonl`` and ``digits_edit/digit_<d>.png`` into ``out_dir`` (each
    file atomically); returns the ``.jsonl`` path."""
    out = Path(out_dir)
    for d, pixels in source_digits().items():
        save_png(pixels.numpy(), out / IMAGE_DIR / f"digit_{d}.png")
    text = "".join(json.dumps(r) + "\n" for r in digits_edit_rows())
    return write_text(out / SAMPLE_FILE, text)
