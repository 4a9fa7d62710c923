"""GenEval's scoring rules (Ghosh et al. 2023, arXiv:2310.11513), pure functions on detections.

A transcription of the logic of djghosh13/geneval ``evaluation/evaluate_images.py`` (MIT) and of
Flow-GRPO's partial score (yifan123/reward-server ``reward_server/gen_eval.py``, MIT); the detector
and the colour classifier are passed in, so every rule is testable on hand-built detections.

A *detection* is ``(box, mask)``: ``box`` a float array ``[5]`` = ``(x0, y0, x1, y1, score)`` in
pixels, ``mask`` a boolean ``[H, W]`` array or None. A prompt's *metadata* is one row of GenEval's
``evaluation_metadata.jsonl``: ``tag``, ``include`` (clauses ``{class, count[, color][, position:
[relation, index of an earlier include]]}``, all must hold) and ``exclude`` (``{class, count}``:
fewer than ``count`` such objects, any failing one fails the image).

The official rules (:func:`select_objects` then :func:`evaluate`):
- per class, detections scoring ``> threshold`` (0.3; 0.9 for the ``counting`` tag), highest score
  first (numpy's ``argsort`` reversed, as the reference), at most ``max_objects`` (16) per class,
  then greedy suppression of boxes whose IoU with a kept one is ``>= max_overlap`` (1.0: off, the
  reference's default);
- an ``include`` clause needs ``count`` objects of its class; colour and position are judged on the
  ``count`` most confident ones: all must have the colour (CLIP zero-shot on the masked crop), and
  each must stand in the relation to every object of the target clause (:func:`relative_position`,
  threshold 0.1); a clause that failed has no objects to be a target;
- an ``exclude`` clause fails when ``count`` or more objects of its class were kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from flowrl.errors import ConfigError

THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
MAX_OVERLAP = 1.0
POSITION_THRESHOLD = 0.1
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
# COCO's 80 classes in their index order, spelt as GenEval's ``object_names.txt`` spells them
COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush")

Detection = tuple  # (box float [5]: x0, y0, x1, y1, score; mask bool [H, W] or None)
ColorsOf = Callable[[str, Sequence[Detection]], list]  # (class name, detections) -> a colour name per detection


@dataclass(frozen=True)
class Rules:
    """The evaluator's settings; the defaults are GenEval's (``evaluate_images.py`` options)."""

    threshold: float = THRESHOLD
    counting_threshold: float = COUNTING_THRESHOLD
    max_objects: int = MAX_OBJECTS
    max_overlap: float = MAX_OVERLAP
    position_threshold: float = POSITION_THRESHOLD


# ---------------------------------------------------------------- detections kept
def compute_iou(box_a, box_b) -> float:
    """IoU of two ``(x0, y0, x1, y1, ...)`` boxes with GenEval's inclusive-pixel areas (``+ 1``)."""
    def area(b):
        return max(b[2] - b[0] + 1, 0) * max(b[3] - b[1] + 1, 0)
    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0


def select_objects(raw: Mapping[str, Sequence[Detection]], tag: str, rules: Rules = Rules()) -> dict[str, list]:
    """The detections GenEval keeps, per class, most confident first (module doc); classes with none
    kept are absent. ``raw``: class name -> detections ``(box [5], mask or None)`` in any order."""
    threshold = rules.counting_threshold if tag == "counting" else rules.threshold
    kept: dict[str, list] = {}
    for name, dets in raw.items():
        if not dets:
            continue
        scores = np.array([float(d[0][4]) for d in dets])  # [n]
        ordering = np.argsort(scores)[::-1]  # the reference's ordering, ties included
        ordering = ordering[scores[ordering] > threshold]
        ordering = ordering[:rules.max_objects].tolist()
        out = []
        while ordering:
            top = ordering.pop(0)
            out.append(dets[top])
            ordering = [o for o in ordering
                        if rules.max_overlap == 1 or compute_iou(dets[top][0], dets[o][0]) < rules.max_overlap]
        if out:
            kept[name] = out
    return kept


def relative_position(obj_a: Detection, obj_b: Detection, position_threshold: float = POSITION_THRESHOLD) -> set:
    """Where A is relative to B: a subset of :data:`RELATIONS`. The centre offset shrinks by
    ``position_threshold`` x (the summed widths / heights) on each axis; a relation holds when the
    shrunk offset's component along it exceeds half the full offset's length (so diagonals count)."""
    boxes = np.array([np.asarray(obj_a[0], dtype=float)[:4], np.asarray(obj_b[0], dtype=float)[:4]]).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)  # [2] each: (cx, cy)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]  # [2] each: (w, h)
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - position_threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rels = set()
    if dx < -0.5:
        rels.add("left of")
    if dx > 0.5:
        rels.add("right of")
    if dy < -0.5:
        rels.add("above")
    if dy > 0.5:
        rels.add("below")
    return rels


# ---------------------------------------------------------------- the verdicts
def _position_holds(found: Sequence[Detection], targets: Sequence[Detection], relation: str,
                    position_threshold: float) -> tuple[bool, str]:
    for obj in found:
        for target in targets:
            rels = relative_position(obj, target, position_threshold)
            if relation not in rels:
                return False, f"found {' and '.join(sorted(rels)) or 'no relation to the'} target"
    return True, ""


def _color_reason(req: dict, colors: list) -> str:
    seen = ", ".join(f"{colors.count(c)} {c}" for c in COLORS if c in colors)
    return f"expected {req['color']} {req['class']}>={req['count']}, found {colors.count(req['color'])} {req['color']}" \
           f"; and {seen}"


def evaluate(objects: Mapping[str, list], metadata: Mapping, colors_of: ColorsOf, rules: Rules = Rules()
             ) -> tuple[bool, str]:
    """GenEval's official verdict of one image: (correct, the reasons it is not, one per line).
    ``objects``: :func:`select_objects`'s output; ``colors_of(class, detections)`` names the colour
    of each detection (called only for clauses with a colour whose count is met)."""
    correct, reasons, groups = True, [], []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        matched = True
        found = objects.get(name, [])[:count]
        if len(found) < count:
            correct = matched = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colors = list(colors_of(name, found))
                if colors.count(req["color"]) < count:
                    correct = matched = False
                    reasons.append(_color_reason(req, colors))
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    correct = matched = False
                    reasons.append(f"no target for {name} to be {relation}")
                else:
                    ok, why = _position_holds(found, groups[target], relation, rules.position_threshold)
                    if not ok:
                        correct = matched = False
                        reasons.append(f"expected {name} {relation} target, {why}")
        groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {len(objects[req['class']])}")
    return correct, "\n".join(reasons)


def evaluate_partial(objects: Mapping[str, list], metadata: Mapping, colors_of: ColorsOf, rules: Rules = Rules()
                     ) -> tuple[bool, float]:
    """Flow-GRPO's GenEval reward (reward-server ``evaluate_reward``): (strict verdict, partial score).

    Per include clause: ``1 - |count - n| / count`` for the ``n`` kept objects of its class (all of
    them, not the top ``count``; negative when ``n > 2 count``); with a colour, the same of the
    number of that colour (or 0.0 when the count is not exact); with a position, 0.0 when no target
    and when the relation fails, then 1.0 whenever a target exists (the reference appends both on a
    failure). The score is the mean of these terms (0 without any). The strict verdict needs exact
    counts and ignores ``exclude``, as the reference does."""
    strict, terms, groups = True, [], []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        matched = True
        found = objects.get(name, [])
        terms.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            strict = matched = False
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                n_color = list(colors_of(name, found)).count(req["color"])
                terms.append(1 - abs(count - n_color) / count)
                if n_color != count:
                    strict = matched = False
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    strict = matched = False
                    terms.append(0.0)
                else:
                    ok, _ = _position_holds(found, groups[target], relation, rules.position_threshold)
                    if not ok:
                        strict = matched = False
                        terms.append(0.0)
                    terms.append(1.0)
        groups.append(found if matched else None)
    return strict, (sum(terms) / len(terms) if terms else 0.0)


def summary(tags: Sequence[str], correct: Sequence[float]) -> dict:
    """GenEval's ``summary_scores.py``: the fraction correct per tag (tags in order of first
    appearance) and the overall score, the mean over tags (not over images). NaN entries (images
    without clauses) are left out; a tag with none scored is NaN and listed in ``unscored``, and then
    the overall is NaN: a mean over the tags that happen to have scores is not GenEval's score."""
    per: dict[str, list] = {t: [] for t in tags}
    for t, c in zip(tags, correct):
        if c == c:  # not NaN
            per[t].append(float(c))
    tag_scores = {t: float(np.mean(v)) if v else float("nan") for t, v in per.items()}
    unscored = [t for t, v in per.items() if not v]
    overall = float(np.mean(list(tag_scores.values()))) if tag_scores and not unscored else float("nan")
    return {"overall": overall, "tags": tag_scores, "images": sum(len(v) for v in per.values()), "unscored": unscored}


# ---------------------------------------------------------------- metadata rows
def _check_clause(c, i: int, where: str, kind: str, earlier: int) -> None:
    what = f"{where}: {kind}[{i}]"
    if not isinstance(c, dict) or not isinstance(c.get("class"), str) or not c["class"]:
        raise ConfigError(f"{what} must be an object with a 'class' name, got {c!r}")
    n = c.get("count")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{what}: 'count' must be a positive integer, got {n!r}")
    extra = set(c) - ({"class", "count", "color", "position"} if kind == "include" else {"class", "count"})
    if extra:
        raise ConfigError(f"{what}: unknown field(s) {sorted(extra)}; a {kind} clause has class, count"
                          + (", color, position" if kind == "include" else ""))
    if "color" in c and c["color"] not in COLORS:
        raise ConfigError(f"{what}: color {c['color']!r} is not one of GenEval's {', '.join(COLORS)}")
    if "position" in c:
        p = c["position"]
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and p[0] in RELATIONS and isinstance(p[1], int)
                and 0 <= p[1] < earlier):
            raise ConfigError(f"{what}: position must be [relation, index of an earlier include clause] with a "
                              f"relation among {', '.join(RELATIONS)}, got {p!r}")


def check_metadata(row: Mapping, where: str = "GenEval metadata") -> dict:
    """A metadata row's clauses, checked: ``{"tag", "include", "exclude"}`` (module doc). A row with a
    ``tag`` (or clauses) but without its ``include`` clauses, or with malformed ones, is a
    :class:`~flowrl.errors.ConfigError` naming ``where`` and the field."""
    if not isinstance(row, Mapping):
        raise ConfigError(f"{where}: a GenEval metadata row must be an object with tag and include, got {row!r}")
    tag = row.get("tag")
    if not isinstance(tag, str) or not tag:
        raise ConfigError(f"{where}: GenEval clauses need a 'tag' (one of {', '.join(TAGS)}), found fields "
                          f"{sorted(row)}")
    include = row.get("include")
    if not isinstance(include, list) or not include:
        raise ConfigError(f"{where}: tag {tag!r} without its 'include' clauses (a non-empty list of "
                          f"{{class, count}}); found fields {sorted(row)}")
    exclude = row.get("exclude", [])
    if not isinstance(exclude, list):
        raise ConfigError(f"{where}: 'exclude' must be a list of {{class, count}}, got {exclude!r}")
    for i, c in enumerate(include):
        _check_clause(c, i, where, "include", i)
    for i, c in enumerate(exclude):
        _check_clause(c, i, where, "exclude", 0)
    return {"tag": tag, "include": [dict(c) for c in include], "exclude": [dict(c) for c in exclude]}


def has_clauses(row: Optional[Mapping]) -> bool:
    """Whether a row claims GenEval clauses (a GenEval ``tag`` or an ``include`` / ``exclude`` field):
    such a row must pass :func:`check_metadata`."""
    return isinstance(row, Mapping) and (row.get("tag") in TAGS or "include" in row or "exclude" in row)
