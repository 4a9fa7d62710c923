"""``geneval``: GenEval's verdict per image (Ghosh et al. 2023, arXiv:2310.11513), on any detector.

reward = 1.0 when the image satisfies its prompt's clauses under GenEval's official rules
(:mod:`flowrl.rewards.geneval_rules`), else 0.0; NaN for a prompt without clauses (not applicable).
``score="partial"`` gives Flow-GRPO's partial score instead (the mean of per-clause terms, what
Flow-GRPO trains on), ``score="strict"`` Flow-GRPO's strict verdict (exact counts).

Clauses: the ``metadata=`` keyword (one GenEval metadata row or None per image: ``tag``,
``include``, ``exclude``, as ``flowrl eval`` passes a ``.jsonl`` suite's rows); else the prompt
text's row in the shipped ``geneval`` set (GenEval's 553 evaluation prompts) or in the ``metadata``
files given (``.jsonl`` rows with a ``prompt``, e.g. Flow-GRPO's ``train_metadata.jsonl``), by exact
match. A ``metadata`` entry may also name a built-in set (:data:`METADATA_SETS`): ``shapes``, the
230 rows of the shapes world (:mod:`flowrl.data.shapes`, train and held out). A row that claims
clauses but lacks or garbles them is an error naming it.

``detector``: ``"module:callable"`` (default flowrl's transformers Mask2Former,
:class:`flowrl.rewards.geneval_detectors.Mask2FormerDetector`); a class or factory is called with
``detector_options`` (and ``device`` when it takes one), a function of the images is the detector.
Its contract: :func:`flowrl.rewards.geneval_detectors.check_detections`. ``colors``: the colour
classifier, ``"module:callable"`` (default CLIP zero-shot on the masked crop,
:class:`flowrl.rewards.geneval_colors.ClipColors` on ``clip_model``), built only when a clause names
a colour: a class or factory is called with those of ``clip_model`` (also offered as ``model``),
``device`` and ``bgcolor`` it takes; a function ``(image uint8 [H, W, 3], class name, detections)
-> [colour name per detection]`` is the classifier. For the shapes world:
``flowrl.rewards.shapes_detector:ShapesDetector`` and ``:PaletteColors`` (docs/rewards.md).
"""
from __future__ import annotations

import inspect
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence, Union

import torch

from flowrl.errors import ConfigError
from flowrl.options import (Device, Fraction, ModelSource, NonNegativeFloat, PositiveInt, Reads, check_options,
                            declared)

from ._clip_common import check_inputs, chunks
from .geneval_rules import Rules, check_metadata, evaluate, evaluate_partial, has_clauses, select_objects
from .ocr import to_uint8_hwc

DEFAULT_DETECTOR = "flowrl.rewards.geneval_detectors:Mask2FormerDetector"
DEFAULT_COLORS = "flowrl.rewards.geneval_colors:ClipColors"
# built-in metadata names -> the shipped prompt set holding their rows (flowrl.data.prompts.NAMED)
METADATA_SETS = {"shapes": "shapes-geneval"}  # the shapes world, all 230 rows (train and held out)
MetadataFile = Annotated[str, Reads("file", names=tuple(METADATA_SETS))]
SCORES = ("official", "partial", "strict")


def shipped_metadata_path() -> Path:
    """GenEval's ``evaluation_metadata.jsonl`` as shipped (the ``geneval`` prompt set)."""
    from flowrl.data.prompts import NAMED, SETS_DIR

    return SETS_DIR / NAMED["geneval"]


def metadata_file(spec: str) -> str:
    """The file of a ``metadata`` entry: a built-in name's shipped set (:data:`METADATA_SETS`), else the
    path, resolved."""
    if spec in METADATA_SETS:
        from flowrl.data.prompts import NAMED, SETS_DIR

        return str(SETS_DIR / NAMED[METADATA_SETS[spec]])
    return str(Path(spec).expanduser().resolve())


@lru_cache(maxsize=8)
def metadata_table(path: str) -> dict[str, dict]:
    """prompt text -> checked clauses, of a ``.jsonl`` metadata file (rows with ``prompt`` and clauses;
    rows without clauses are skipped, rows that claim them must be well-formed)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"GenEval metadata file {str(p)!r} not found; give a .jsonl with one "
                                f"{{prompt, tag, include[, exclude]}} row per prompt")
    from flowrl.data.prompts import jsonl_rows

    table: dict[str, dict] = {}
    for i, row in jsonl_rows(p.read_text(encoding="utf-8"), p):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and has_clauses(row):
            table.setdefault(row["prompt"], check_metadata(row, f"{p}:{i}"))
    return table


def load_target(spec: str, what: str):
    """The object ``"module:attr"`` names (the current directory importable, as ``python -m`` has it)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} must be 'module:callable', got {spec!r}")
    mod, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        import importlib

        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {spec!r} cannot be loaded: {e}") from None
    if not callable(obj):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return obj


def build_detector(spec: str, options: dict, device: str):
    """A detector from ``spec`` (module doc): classes and factories get ``options`` (+ ``device``)."""
    target = load_target(spec, "reward.options.geneval.detector")
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: take it as a function of the images
        return target
    required = [p for p in params.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not inspect.isclass(target) and not options and required:
        return target  # a function of the images: the detector itself
    declared_opts, is_open = declared(target)
    try:  # the detector's typed options: an unknown key or a value out of range is one line
        check_options("reward.options.geneval.detector_options", f"the detector {spec}", declared_opts, options,
                      open=is_open)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    opts = dict(options)
    if "device" in params:
        opts.setdefault("device", device)
    return target(**opts)


def build_colors(target, offered: dict):
    """The colour classifier from a loaded ``colors`` target (module doc): a class or factory gets the
    ``offered`` keywords it names; a function (required positional parameters, not a class) is the
    classifier itself."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the classifier itself
        return target
    required = [p for p in params.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if required and not inspect.isclass(target):
        return target
    return target(**{k: v for k, v in offered.items() if k in params})


class GenEval:
    """GenEval's verdict (or Flow-GRPO's partial score) per image; float32 [B] on CPU (module doc)."""

    name = "geneval"
    takes_metadata = True  # flowrl eval passes each row's clauses as metadata=
    @classmethod
    def resident_for(cls, options: dict) -> tuple[Optional[int], str]:
        """``(parameters, note)`` this reward keeps loaded with ``options`` (``flowrl plan``): what its ``detector``
        and ``colors`` targets declare (``resident_params``), e.g. nothing for the shapes world's readers;
        ``(None, why)`` when one of them declares nothing."""
        parts, notes = 0, []
        for key, default in (("detector", DEFAULT_DETECTOR), ("colors", DEFAULT_COLORS)):
            spec = options.get(key, default)
            params = getattr(load_target(spec, f"reward.options.geneval.{key}"), "resident_params", None)
            if params is None:
                return None, f"resident size unknown: not counted ({key} {spec} declares no resident_params)"
            parts += int(params)
            notes.append(f"{key} {spec.rpartition(':')[2]} {params / 1e6:g}M")
        return parts, ", ".join(notes)

    def __init__(self, detector: str = DEFAULT_DETECTOR, detector_options: Optional[dict] = None,
                 clip_model: ModelSource = "openai/clip-vit-large-patch14", device: Device = "cpu",
                 score: Literal[SCORES] = "official", metadata: Union[None, MetadataFile, Sequence[MetadataFile]] = None,
                 threshold: Fraction = 0.3, counting_threshold: Fraction = 0.9, max_objects: PositiveInt = 16,
                 max_overlap: Fraction = 1.0, position_threshold: NonNegativeFloat = 0.1, bgcolor: str = "#999",
                 batch_size: PositiveInt = 8, colors: str = DEFAULT_COLORS):
        if score not in SCORES:
            raise ConfigError(f"geneval score must be one of {', '.join(SCORES)}, got {score!r}")
        self.score, self.device, self.batch_size = score, device, int(batch_size)
        self.rules = Rules(threshold, counting_threshold, int(max_objects), max_overlap, position_threshold)
        self.detector_name = detector
        self.detector = build_detector(detector, dict(detector_options or {}), device)
        self.clip_model, self.bgcolor, self._colors = clip_model, bgcolor, None
        self.colors_target = load_target(colors, "reward.options.geneval.colors")  # built on first use
        files = [str(shipped_metadata_path())] + ([metadata] if isinstance(metadata, str) else list(metadata or []))
        self.table: dict[str, dict] = {}
        for f in files:
            for k, v in metadata_table(metadata_file(str(f))).items():
                self.table.setdefault(k, v)

    def clauses(self, prompts: Sequence[str], metadata: Optional[Sequence] = None) -> list[Optional[dict]]:
        """Each image's checked clauses (module doc), or None where there are none."""
        if metadata is not None and len(metadata) != len(prompts):
            raise ConfigError(f"geneval got {len(metadata)} metadata rows for {len(prompts)} images")
        out = []
        for i, p in enumerate(prompts):
            row = metadata[i] if metadata is not None else None
            if has_clauses(row):
                out.append(check_metadata(row, f"metadata of prompt {p!r}"))
            else:
                out.append(self.table.get(p))
        return out

    def colors_of(self, image):
        """The colour callback of one uint8 image ``[H, W, 3]`` (the classifier is built on first use)."""
        def colors(class_name, detections):
            if self._colors is None:
                offered = {"clip_model": self.clip_model, "model": self.clip_model, "device": self.device,
                           "bgcolor": self.bgcolor}
                self._colors = build_colors(self.colors_target, offered)
            return self._colors(image, class_name, detections)
        return colors

    def verdict(self, detections: dict, rows: dict, image) -> float:
        """One image's score from its raw detections and clauses."""
        objects = select_objects(detections, rows["tag"], self.rules)
        if self.score == "official":
            return float(evaluate(objects, rows, self.colors_of(image), self.rules)[0])
        strict, partial = evaluate_partial(objects, rows, self.colors_of(image), self.rules)
        return float(strict) if self.score == "strict" else float(partial)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Optional[Sequence] = None,
                 **meta) -> torch.Tensor:
        check_inputs(images, prompts, self.name)
        rows = self.clauses(list(prompts), metadata)
        out = torch.full((len(prompts),), float("nan"))
        idx = [i for i, r in enumerate(rows) if r is not None]
        if not idx:
            return out
        from .geneval_detectors import check_detections

        for s in chunks(len(idx), self.batch_size):
            part = idx[s]
            batch = images[part]  # [b, 3, H, W]
            found = check_detections(self.detector(batch), len(part), batch.shape[-2], batch.shape[-1],
                                     repr(self.detector_name))
            pixels = to_uint8_hwc(batch)  # [b, H, W, 3]
            for j, i in enumerate(part):
                out[i] = self.verdict(found[j], rows[i], pixels[j])
        return out
