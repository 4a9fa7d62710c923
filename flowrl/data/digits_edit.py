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
parses the instruction itself).

The multi-source sample (``digits_edit_multi_sample.jsonl``, named ``digits-edit-multi-sample``, the
same PNGs) has rows with two or three sources, ``"image": [paths, in order]``, whose instructions
need every source in order (the ``digits_edit`` reward's combine forms): the sum of the digits
(:data:`SUM_EDITS`), the first digit minus the second (:data:`DIFFERENCE_EDITS`; each pair's
reverse asks for another digit), the digit of picture K (:data:`PICK_EDITS`); plus two one-source
rows, so a batch mixes one, two and three sources. Its rows carry ``source_digits`` (a list) and
``target_digit``. A separate file, because FLUX.1 Kontext takes one source per prompt and the
one-source sample's runs stay what they were. Regenerate both with ``write_digits_edit_set(SETS_DIR)``.
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
MULTI_SAMPLE_FILE = "digits_edit_multi_sample.jsonl"
IMAGE_DIR = "digits_edit"
# change edits: each digit into one drawn alike
CHANGE_TO = {0: 8, 1: 7, 2: 3, 3: 8, 4: 9, 5: 6, 6: 5, 7: 1, 8: 3, 9: 4}
# stroke edits: (digit, "thicker" | "thinner")
STROKE_EDITS = ((0, "thicker"), (4, "thicker"), (1, "thicker"), (8, "thinner"))
# multi-source edits (sources in order): sums at most 9, differences whose reverse differs, picks
SUM_EDITS = ((2, 3), (1, 6), (4, 5), (1, 2, 4), (0, 3, 5))
DIFFERENCE_EDITS = ((9, 2), (6, 4), (8, 1))
PICK_EDITS = (((3, 7), 2), ((5, 0), 1), ((1, 8, 6), 3))
MULTI_SINGLE_EDITS = ((2, 3), (9, 4))  # one-source change rows of the multi-source sample

__all__ = ["SAMPLE_FILE", "MULTI_SAMPLE_FILE", "IMAGE_DIR", "CHANGE_TO", "STROKE_EDITS", "SUM_EDITS",
           "DIFFERENCE_EDITS", "PICK_EDITS", "source_digits", "digits_edit_rows", "digits_edit_multi_rows",
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


def digits_edit_multi_rows() -> list[dict]:
    """The multi-source sample's rows, in file order (module doc)."""
    image = lambda d: f"{IMAGE_DIR}/digit_{d}.png"  # noqa: E731
    names = {2: "two", 3: "three"}
    rows = [{"prompt": f"write the sum of the {names[len(ds)]} digits", "image": [image(d) for d in ds],
             "source_digits": list(ds), "target_digit": sum(ds) % 10} for ds in SUM_EDITS]
    rows += [{"prompt": "subtract the digit in picture 2 from the digit in picture 1", "image": [image(a), image(b)],
              "source_digits": [a, b], "target_digit": (a - b) % 10} for a, b in DIFFERENCE_EDITS]
    rows += [{"prompt": f"show the digit from picture {k}", "image": [image(d) for d in ds],
              "source_digits": list(ds), "target_digit": ds[k - 1]} for ds, k in PICK_EDITS]
    rows += [{"prompt": f"turn this {d} into {'an' if t == 8 else 'a'} {t}", "image": image(d), "source_digits": [d],
              "target_digit": t} for d, t in MULTI_SINGLE_EDITS]
    return rows


def write_digits_edit_set(out_dir: Union[str, os.PathLike]) -> Path:
    """Write ``digits_edit_sample.jsonl``, ``digits_edit_multi_sample.jsonl`` and
    ``digits_edit/digit_<d>.png`` into ``out_dir`` (each file atomically); returns the one-source
    ``.jsonl`` path."""
    out = Path(out_dir)
    for d, pixels in source_digits().items():
        save_png(pixels.numpy(), out / IMAGE_DIR / f"digit_{d}.png")
    write_text(out / MULTI_SAMPLE_FILE, "".join(json.dumps(r) + "\n" for r in digits_edit_multi_rows()))
    text = "".join(json.dumps(r) + "\n" for r in digits_edit_rows())
    return write_text(out / SAMPLE_FILE, text)
