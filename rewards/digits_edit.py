"""``digits_edit``: an offline editing reward on digits, scored by flowrl's own digits classifier.

It scores a result image given the **source** image it was edited from and the instruction, with
the classifier of the ``digits`` reward (``flowrl.rewards.digits``: an MLP on the 8 x 8 grey view,
trained offline on scikit-learn's bundled digits, cached). For tests and the CPU demo of editing
(the shipped ``digits_edit_sample.jsonl``); real editing runs use the VLM judge.

The source comes through the reward's keyword metadata: ``reward(images, prompts, sources=...)``
with ``sources`` a list of float ``[3, H, W]`` tensors in [0, 1] or None per row (or one
``[B, 3, H, W]`` tensor). Instructions it understands (case-insensitive; digits as numerals or words):

* **change**: ``"... into (a|an) B"`` -> ``p(B | result)``.
* **strokes**: ``"... thicker"`` / ``"bolder"`` or ``"... thinner"`` / ``"lighter"`` -> ``p(d | result) x
  s`` with ``d`` the digit the instruction names (else the classifier's reading of the source) and
  the stroke term ``s = clamp((r - 1) / c, 0, 1)`` for thicker, ``clamp((1 - r) / c, 0, 1)`` for
  thinner, where ``r = ink(result) / ink(source)`` is the ratio of mean grey values on the 8 x 8
  view and ``c = stroke_change`` (0.5: 50% more ink, or 50% less, scores 1). The digit must stay
  ``d`` while the strokes change.

Result: float32 ``[B]`` in [0, 1]. NaN (not applicable) for a row without a source (no ``sources``
given at all: every row) and for an instruction that is neither form. Results and sources may have
any size (both are pooled to the classifier's 8 x 8 view).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from flowrl.data.digits import parse_digit

from ._clip_common import check_inputs
from .digits import load_classifier, to_8x8

_INTO = re.compile(r"\binto\s+(?:an?\s+)?([a-z0-9]+)")
_THICKER = re.compile(r"\b(thicker|bolder)\b")
_THINNER = re.compile(r"\b(thinner|lighter)\b")
_EPS = 1e-6


@dataclass(frozen=True)
class EditSpec:
    """What an instruction asks: ``kind`` is ``"change"``, ``"thicker"`` or ``"thinner"``; ``digit``
    the digit the result must show (None for a stroke edit that names none: read from the source)."""

    kind: str
    digit: Optional[int]


def parse_edit(instruction: str) -> Optional[EditSpec]:
    """The :class:`EditSpec` of an instruction, or None when it is neither form (module doc)."""
    text = instruction.lower()
    m = _INTO.search(text)
    if m:
        target = parse_digit(m.group(1))
        return None if target is None else EditSpec("change", target)
    for kind, pattern in (("thicker", _THICKER), ("thinner", _THINNER)):
        if pattern.search(text):
            return EditSpec(kind, parse_digit(text))
    return None


Sources = Union[None, torch.Tensor, Sequence[Optional[torch.Tensor]]]


def _per_row_sources(sources: Sources, n: int) -> list[Optional[torch.Tensor]]:
    if sources is None:
        return [None] * n
    if len(sources) != n:
        raise ValueError(f"digits_edit reward got {n} images but {len(sources)} sources; pass one source "
                         f"(or None) per image")
    rows = list(sources)
    for i, s in enumerate(rows):
        if s is not None and not (isinstance(s, torch.Tensor) and s.ndim == 3 and s.shape[0] == 3):
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"digits_edit reward: source {i} must be a float [3, H, W] tensor in [0, 1] or None, "
                             f"got {shape}")
    return rows


class DigitsEditReward:
    """Editing reward in [0, 1], float32 [B]; NaN where not applicable (module doc).

    Args:
        device: where the classifier runs.
        cache_dir: the classifier's cache (default: the digits cache of ``FLOWRL_HOME``).
        stroke_change: relative ink change that scores 1 on a stroke edit (> 0).
    """

    name = "digits_edit"
    resident_params = 19_210  # parameters kept loaded, for `flowrl plan`
    resident_note = "flowrl's digits classifier (the digits reward's)"

    def __init__(self, device: str = "cpu", cache_dir: Optional[str] = None, stroke_change: float = 0.5):
        if not stroke_change > 0:
            raise ValueError(f"stroke_change must be > 0, got {stroke_change}")
        self.device = torch.device(device)
        self.stroke_change = float(stroke_change)
        self.model = load_classifier(Path(cache_dir) if cache_dir else None).to(self.device)

    @torch.no_grad()
    def probs(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``[B, 10]`` of images ``[B, 3, H, W]`` in [0, 1]."""
        return self.model(to_8x8(images.to(self.device))).softmax(-1).cpu()

    def __call__(self, images: torch.Tensor, prompts: list[str], *, sources: Sources = None, **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        rows = _per_row_sources(sources, len(prompts))
        specs = [parse_edit(p) if src is not None else None for p, src in zip(prompts, rows)]
        out = torch.full((len(prompts),), float("nan"))
        todo = [i for i, s in enumerate(specs) if s is not None]
        if not todo:
            return out
        result = images[todo].float()  # [n, 3, H, W]
        src = torch.stack([to_8x8(rows[i].float()[None])[0] for i in todo])  # [n, 64] grey 8 x 8 views
        p_result = self.probs(result)  # [n, 10]
        p_source = self.model(src.to(self.device)).softmax(-1).cpu()  # [n, 10]
        ink_ratio = to_8x8(result).mean(1) / src.mean(1).clamp_min(_EPS)  # [n]
        for j, i in enumerate(todo):
            spec = specs[i]
            digit = spec.digit if spec.digit is not None else int(p_source[j].argmax())
            score = p_result[j, digit]
            if spec.kind == "thicker":
                score = score * ((ink_ratio[j] - 1) / self.stroke_change).clamp(0, 1)
            elif spec.kind == "thinner":
                score = score * ((1 - ink_ratio[j]) / self.stroke_change).clamp(0, 1)
            out[i] = score
        return out
