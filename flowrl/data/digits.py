"""The digits data: scikit-learn's bundled 8 x 8 digits at 16 x 16, and the prompts that name them.

Shared by the digits model (``flowrl.pipelines.digits``) and the digits reward
(``flowrl.rewards.digits``), neither of which imports the other.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F


IMAGE_SIZE = 16
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

__all__ = ["IMAGE_SIZE", "DIGIT_WORDS", "digit_prompt", "parse_digit", "digits_dataset"]


def digit_prompt(d: int) -> str:
    return f"a handwritten digit {d}"


def parse_digit(prompt: str) -> Optional[int]:
    """The digit a prompt names (numeral or word), or None."""
    for tok in re.findall(r"[a-z0-9]+", prompt.lower()):
        if tok.isdigit() and len(tok) == 1:
            return int(tok)
        if tok in DIGIT_WORDS:
            return DIGIT_WORDS.index(tok)
    return None


def digits_dataset(split: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits as ``([N, 1, 16, 16] in [-1, 1], labels [N])``.

    ``split``: ``"train"`` (first 80% in a fixed shuffle), ``"test"`` (the rest) or ``"all"``.
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)  # [N, 1, 16, 16]
    y = torch.tensor(d.target, dtype=torch.long)  # [N]
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    idx = {"train": perm[:cut], "test": perm[cut:], "all": torch.arange(len(y))}[split]
    return x[idx] * 2 - 1, y[idx]
