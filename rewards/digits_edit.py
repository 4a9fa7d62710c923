"""``digits_edit``: an offline editing reward on digits, scored by flowrl's own digits classifier.

It scores a result image given the **source** image it was edited from and the instruction, with
the classifier of the ``digits`` reward (``flowrl.rewards.digits``: an MLP on the 8 x 8 grey view,
trained offline on scikit-learn's bundled digits, cached). For tests and the CPU demo of editing
(the shipped ``digits_edit_sample.jsonl``); real editing runs use the VLM judge.

The sources come through the reward's keyword metadata: ``reward(images, prompts, sources=...)``
with one entry per row: None, a float ``[3, H, W]`` tensor in [0, 1] (one source), or a sequence of
them (several sources, in order: picture 1, picture 2, ...); one ``[B, 3, H, W]`` tensor is one source
per row. Instructions it understands (case-insensitive; digits as numerals or words):

* **change**: ``"... into (a|an) B"`` -> ``p(B | result)``.
* **strokes**: ``"... thicker"`` / ``"bolder"`` or ``"... thinner"`` / ``"lighter"`` -> ``p(d | result) x
  s`` with ``d`` the digit the instruction names (else the classifier's reading of the source) and
  the stroke term ``s = clamp((r - 1) / c, 0, 1)`` for thicker, ``clamp((1 - r) / c, 0, 1)`` for
  thinner, where ``r = ink(result) / ink(source)`` is the ratio of mean grey values on the 8 x 8
  view and ``c = stroke_change`` (0.5: 50% more ink, or 50% less, scores 1). The digit must stay
  ``d`` while the strokes change. (With several sources these read picture 1.)
* **combine** (several sources; ``d_k`` is the classifier's reading of picture ``k``):
  ``"... sum ..."`` -> ``p((d_1 + ... + d_n) mod 10 | result)`` (every source counts);
  ``"subtract ..."`` / ``"... minus ..."`` / ``"... difference ..."`` -> ``p((d_1 - d_2) mod 10 | result)``
  (exactly two sources, in order: swapping them changes the target);
  ``"... picture K ..."`` (or ``image K``) -> ``p(d_K | result)`` (the digit of the K-th source).
  A row without the sources its instruction needs is NaN.

Result: float32 ``[B]`` in [0, 1]. NaN (not applicable) for a row without a source (no ``sources``
given at all: every row), for an instruction that is none of these forms, and for a combine row
without the sources it needs. Results and sources may have any size (both are pooled to the
classifier's 8 x 8 view).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from flowrl.data.digits import parse_digit
from flowrl.data.items import row_sources
from flowrl.options import Device, PositiveFloat

from ._clip_common import check_inputs
from .digits import load_classifier, to_8x8

_INTO = re.compile(r"\binto\s+(?:an?\s+)?([a-z0-9]+)")
_THICKER = re.compile(r"\b(thicker|bolder)\b")
_THINNER = re.compile(r"\b(thinner|lighter)\b")
_SUM = re.compile(r"\bsum\b")
_DIFFERENCE = re.compile(r"\b(subtract|minus|difference)\b")
_PICTURE = re.compile(r"\b(?:picture|image)\s+([1-9])\b")
_EPS = 1e-6
COMBINE_KINDS = ("sum", "difference", "pick")  # the instructions that read several sources


@dataclass(frozen=True)
class EditSpec:
    """What an instruction asks: ``kind`` is ``"change"``, ``"thicker"``, ``"thinner"`` or a combine kind
    (``"sum"``, ``"difference"``, ``"pick"``); ``digit`` the digit the result must show when the
    instruction names it (None: read from the sources); ``picture`` the 1-based source a ``"pick"`` reads."""

    kind: str
    digit: Optional[int]
    picture: Optional[int] = None


def parse_edit(instruction: str) -> Optional[EditSpec]:
    """The :class:`EditSpec` of an instruction, or None when it is none of the forms (module doc)."""
    text = instruction.lower()
    m = _INTO.search(text)
    if m:
        target = parse_digit(m.group(1))
        return None if target is None else EditSpec("change", target)
    if _SUM.search(text):
        return EditSpec("sum", None)
    if _DIFFERENCE.search(text):
        return EditSpec("difference", None)
    m = _PICTURE.search(text)
    if m:
        return EditSpec("pick", None, int(m.group(1)))
    for kind, pattern in (("thicker", _THICKER), ("thinner", _THINNER)):
        if pattern.search(text):
            return EditSpec(kind, parse_digit(text))
    return None


def combine_target(spec: EditSpec, digits: Sequence[int]) -> Optional[int]:
    """The digit a combine instruction asks for, given the digits of the row's sources in order
    (``picture 1`` first), or None when the row lacks the sources it needs (module doc)."""
    if spec.kind == "sum":
        return sum(digits) % 10 if len(digits) >= 2 else None
    if spec.kind == "difference":
        return (digits[0] - digits[1]) % 10 if len(digits) == 2 else None
    if spec.kind == "pick":
        return digits[spec.picture - 1] if spec.picture <= len(digits) else None
    raise ValueError(f"{spec.kind!r} is not a combine instruction ({COMBINE_KINDS})")


Sources = Union[None, torch.Tensor, Sequence[Union[None, torch.Tensor, Sequence[torch.Tensor]]]]


def _per_row_sources(sources: Sources, n: int) -> list[tuple[torch.Tensor, ...]]:
    """Each row's sources as a tuple of ``[3, H, W]`` tensors, in order (``()``: none)."""
    if sources is None:
        return [()] * n
    if len(sources) != n:
        raise ValueError(f"digits_edit reward got {n} images but {len(sources)} sources; pass one entry "
                         f"(None, a source, or a list of sources) per image")
    rows = [row_sources(entry) for entry in sources]
    for i, row in enumerate(rows):
        for s in row:
            if not (isinstance(s, torch.Tensor) and s.ndim == 3 and s.shape[0] == 3):
                shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"digits_edit reward: source {i} must be a float [3, H, W] tensor in [0, 1], a "
                                 f"list of them, or None; got {shape}")
    return rows


class DigitsEditReward:
    """Editing reward in [0, 1], float32 [B]; NaN where not applicable (module doc).

    Args:
        device: where the classifier runs.
        cache_dir: the classifier's cache (default: the digits cache of ``FLOWRL_HOME``).
        stroke_change: relative ink change that scores 1 on a stroke edit (> 0).
    """

    name = "digits_edit"
    needs_sources = True  # a row without a source is NaN: on prompts without any, nothing is scored (flowrl.conditions)
    resident_params = 19_210  # parameters kept loaded, for `flowrl plan`
    resident_note = "flowrl's digits classifier (the digits reward's)"

    def __init__(self, device: Device = "cpu", cache_dir: Optional[str] = None, stroke_change: PositiveFloat = 0.5):
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
        specs = [parse_edit(p) if src else None for p, src in zip(prompts, rows)]
        out = torch.full((len(prompts),), float("nan"))
        todo = [i for i, s in enumerate(specs) if s is not None]
        if not todo:
            return out
        result = images[todo].float()  # [n, 3, H, W]
        src = torch.stack([to_8x8(rows[i][0].float()[None])[0] for i in todo])  # [n, 64] grey 8 x 8 views (picture 1)
        p_result = self.probs(result)  # [n, 10]
        p_source = self.model(src.to(self.device)).softmax(-1).cpu()  # [n, 10]
        ink_ratio = to_8x8(result).mean(1) / src.mean(1).clamp_min(_EPS)  # [n]
        read = self._read_all([rows[i] for i, s in enumerate(specs) if s is not None and s.kind in COMBINE_KINDS])
        for j, i in enumerate(todo):
            spec = specs[i]
            if spec.kind in COMBINE_KINDS:
                digit = combine_target(spec, next(read))
                if digit is not None:
                    out[i] = p_result[j, digit]
                continue
            digit = spec.digit if spec.digit is not None else int(p_source[j].argmax())
            score = p_result[j, digit]
            if spec.kind == "thicker":
                score = score * ((ink_ratio[j] - 1) / self.stroke_change).clamp(0, 1)
            elif spec.kind == "thinner":
                score = score * ((1 - ink_ratio[j]) / self.stroke_change).clamp(0, 1)
            out[i] = score
        return out

    def _read_all(self, rows: list[tuple[torch.Tensor, ...]]):
        """An iterator over ``rows``: each row's source digits as the classifier reads them, in order
        (every source of every row classified in one batch)."""
        flat = [s for row in rows for s in row]
        if not flat:
            return iter(())
        views = torch.stack([to_8x8(s.float()[None])[0] for s in flat])  # [S, 64]
        digits = self.model(views.to(self.device)).argmax(-1).cpu().tolist()  # [S]
        out, k = [], 0
        for row in rows:
            out.append(digits[k:k + len(row)])
            k += len(row)
        return iter(out)
