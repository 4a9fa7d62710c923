"""The shapes world: scenes of coloured geometric shapes, rendered procedurally, with GenEval's prompts.

A compositional world a 2-core CPU trains on: a few shapes (:data:`SHAPES`) in a few flat colours
(:data:`PALETTE`, GenEval colour names) on a light background, 1-4 objects per scene, and prompts
from GenEval's templates (Ghosh et al. 2023, arXiv:2310.11513) with their six tags and clauses
(``a photo of two red circles`` is not a template; ``a photo of two circles``, ``a photo of a red
circle``, ``a photo of a blue square and a green triangle``, ``a photo of a circle left of a
square`` are). Each prompt's row is a GenEval metadata row (``tag``, ``include``, ``exclude``), so
GenEval's official rules score an image of it (:mod:`flowrl.rewards.geneval_rules`).

Everything here is a pure function of its arguments (a seed or a ``numpy`` generator): the prompt
rows (:func:`shapes_rows`, split into ``train`` and ``heldout`` by a fixed rule), a scene that
satisfies a row (:func:`scene_for`), its pixels (:func:`render`) and the objects' true boxes and
masks (:meth:`Scene.masks`), which the shapes detector must recover exactly on renders.
Shared by the shapes model (``flowrl.pipelines.shapes``) and the shapes detector.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch

from flowrl.rewards.geneval_rules import POSITION_THRESHOLD, RELATIONS, relative_position
from flowrl.data.prompts import NAMED

IMAGE_SIZE = 32  # pixels per side of a scene (pixel space, RGB)
SHAPES = ("circle", "square", "triangle", "diamond")
PLURALS = {s: s + "s" for s in SHAPES}
PALETTE = {"red": (220, 40, 40), "green": (30, 160, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
BACKGROUND = (235, 235, 235)  # light grey: no GenEval colour, far from every palette colour
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
SIZE_RANGE = (0.28, 0.38)  # an object's side as a fraction of the image side
GAP = 2  # pixels between any two objects' boxes
HELDOUT_PER_TAG = 4  # prompts of each tag held out of training (at most half of a tag's; a fixed shuffle)

__all__ = ["IMAGE_SIZE", "SHAPES", "PLURALS", "PALETTE", "BACKGROUND", "COUNT_WORDS", "HELDOUT_PER_TAG", "Shape", "Scene",
           "shape_mask", "extent", "shapes_rows", "scene_for", "render", "shapes_batch", "SET_NAMES", "SET_FILES", "write_shapes_sets"]


@dataclass(frozen=True)
class Shape:
    """One object: ``kind`` (:data:`SHAPES`), ``color`` (:data:`PALETTE`), centre ``(cx, cy)`` and side
    ``size``, all in pixels of the image (x to the right, y down)."""

    kind: str
    color: str
    cx: float
    cy: float
    size: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        """``(x0, y0, x1, y1)`` of the square the shape is drawn in (pixels, continuous)."""
        h = self.size / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)


def shape_mask(kind: str, cx: float, cy: float, size: float, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """The pixels (centres at ``i + 0.5``) inside a shape: bool ``[image_size, image_size]``."""
    c = np.arange(image_size) + 0.5
    x, y = np.meshgrid(c, c)  # [S, S] each; x along columns
    dx, dy, h = x - cx, y - cy, size / 2
    if kind == "square":
        return (np.abs(dx) <= h) & (np.abs(dy) <= h)
    if kind == "circle":
        return dx ** 2 + dy ** 2 <= h ** 2
    if kind == "diamond":
        return np.abs(dx) + np.abs(dy) <= h
    if kind == "triangle":  # apex up, base at the bottom of the box
        return (dy >= -h) & (dy <= h) & (np.abs(dx) <= (dy + h) / 2)
    raise ValueError(f"unknown shape {kind!r}; shapes are {', '.join(SHAPES)}")


@dataclass(frozen=True)
class Scene:
    """The objects of one image, drawn in order (they never overlap: :data:`GAP`)."""

    objects: tuple[Shape, ...]

    def masks(self, image_size: int = IMAGE_SIZE) -> list[np.ndarray]:
        """Each object's pixels, bool ``[S, S]``."""
        return [shape_mask(o.kind, o.cx, o.cy, o.size, image_size) for o in self.objects]

    def pixels(self, image_size: int = IMAGE_SIZE) -> np.ndarray:
        """The 8-bit image ``[S, S, 3]``."""
        img = np.empty((image_size, image_size, 3), dtype=np.uint8)
        img[:] = BACKGROUND
        for o, m in zip(self.objects, self.masks(image_size)):
            img[m] = PALETTE[o.color]
        return img


def render(scenes: Sequence[Scene], image_size: int = IMAGE_SIZE) -> torch.Tensor:
    """The scenes as the model's pixels: float32 ``[B, 3, S, S]`` in [-1, 1]."""
    arr = np.stack([s.pixels(image_size) for s in scenes])  # [B, S, S, 3] uint8
    return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [B, 3, S, S]


# ---------------------------------------------------------------- prompts (GenEval's templates and clauses)
def _a(color: Optional[str], kind: str) -> str:
    return f"a {color} {kind}" if color else f"a {kind}"


def _all_rows() -> list[dict]:
    rows = [{"tag": "single_object", "include": [{"class": s, "count": 1}], "prompt": f"a photo of {_a(None, s)}"}
            for s in SHAPES]
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    rows += [{"tag": "two_object", "include": [{"class": a, "count": 1}, {"class": b, "count": 1}],
              "prompt": f"a photo of a {a} and a {b}"} for a, b in pairs if a < b]
    rows += [{"tag": "counting", "include": [{"class": s, "count": n}], "exclude": [{"class": s, "count": n + 1}],
              "prompt": f"a photo of {COUNT_WORDS[n]} {PLURALS[s]}"} for s in SHAPES for n in (2, 3, 4)]
    rows += [{"tag": "colors", "include": [{"class": s, "count": 1, "color": c}], "prompt": f"a photo of {_a(c, s)}"}
             for s in SHAPES for c in PALETTE]
    rows += [{"tag": "position", "include": [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [r, 0]}],
              "prompt": f"a photo of a {a} {r} a {b}"} for a, b in pairs for r in RELATIONS]
    rows += [{"tag": "color_attr", "include": [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}],
              "prompt": f"a photo of {_a(ca, a)} and {_a(cb, b)}"}
             for a, b in pairs for ca in PALETTE for cb in PALETTE if ca != cb]
    return rows


@lru_cache(maxsize=1)
def _split() -> dict[str, tuple[dict, ...]]:
    rows = _all_rows()
    train, held = [], []
    for tag in dict.fromkeys(r["tag"] for r in rows):
        mine = [r for r in rows if r["tag"] == tag]
        order = np.random.default_rng(0).permutation(len(mine))  # a fixed shuffle per tag
        n_held = min(HELDOUT_PER_TAG, len(mine) // 2)  # single_object 2 of 4, two_object 3 of 6, the rest 4
        for rank, i in enumerate(order):
            (held if rank < n_held else train).append(mine[i])
    return {"train": tuple(train), "heldout": tuple(held), "all": tuple(rows)}


def shapes_rows(split: str = "all") -> list[dict]:
    """GenEval metadata rows (``prompt``, ``tag``, ``include`` [, ``exclude``]) of the shapes prompts:
    ``"train"``, ``"heldout"`` (the first :data:`HELDOUT_PER_TAG` prompts of each tag in a fixed shuffle, at
    most half of the tag's, so every tag weighs about the same in the held-out mean:
    unseen combinations of seen words) or ``"all"``. Fresh dicts (the caller may change them)."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    import copy

    return copy.deepcopy(list(_split()[split]))


# ---------------------------------------------------------------- scenes that satisfy a row
def _place(rng: np.random.Generator, size: float, placed: list[Shape], image_size: int) -> Optional[tuple]:
    """A centre for a new object of side ``size`` whose box keeps :data:`GAP` from every placed one."""
    h = size / 2
    for _ in range(100):
        cx, cy = rng.uniform(h, image_size - h, size=2)
        if all(abs(cx - o.cx) >= h + o.size / 2 + GAP or abs(cy - o.cy) >= h + o.size / 2 + GAP for o in placed):
            return float(cx), float(cy)
    return None


def extent(mask: np.ndarray) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)`` of a non-empty bool ``[H, W]`` mask, ``x1`` = last column + 1: the box a
    detector reports for those pixels."""
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def _pixel_box(obj: Shape, image_size: int) -> tuple[int, int, int, int]:
    """The extent of the object's pixels: the box a detector sees."""
    return extent(shape_mask(obj.kind, obj.cx, obj.cy, obj.size, image_size))


def _holds(obj: Shape, target: Shape, relation: str, image_size: int) -> bool:
    """Whether ``relation`` holds on the objects' pixel boxes (and so for any detector that finds them)."""
    a, b = _pixel_box(obj, image_size), _pixel_box(target, image_size)
    return relation in relative_position(((*a, 1.0),), ((*b, 1.0),), POSITION_THRESHOLD)


def scene_for(row: dict, rng: np.random.Generator, image_size: int = IMAGE_SIZE) -> Scene:
    """A random scene that satisfies ``row``'s clauses exactly: each include clause's ``count``
    objects of its class (its colour, else a random one), in its position relation to the clause it
    names (GenEval's :func:`~flowrl.rewards.geneval_rules.relative_position` on the pixels' boxes,
    what a detector sees), and nothing else."""
    lo, hi = SIZE_RANGE
    for _ in range(200):
        placed: list[Shape] = []
        clause_objects: list[list[Shape]] = []
        for clause in row["include"]:
            mine = []
            for _ in range(int(clause["count"])):
                size = float(rng.uniform(lo, hi) * image_size)
                color = clause.get("color") or str(rng.choice(list(PALETTE)))
                at = _place(rng, size, placed, image_size)
                if at is None:
                    break
                obj = Shape(clause["class"], color, at[0], at[1], size)
                if "position" in clause:
                    relation, target = clause["position"]
                    if not all(_holds(obj, t, relation, image_size) for t in clause_objects[target]):
                        break
                mine.append(obj)
                placed.append(obj)
            if len(mine) < int(clause["count"]):
                break
            clause_objects.append(mine)
        else:
            return Scene(tuple(placed))
    raise RuntimeError(f"no scene found for {row['prompt']!r} at {image_size} pixels in 200 tries")


def shapes_batch(n: int, generator: np.random.Generator, split: str = "train", image_size: int = IMAGE_SIZE
                 ) -> tuple[torch.Tensor, list[str]]:
    """``n`` training pairs: a row of ``split`` drawn uniformly per tag then per prompt (each tag as
    often), a scene for it, its pixels. Returns ``(images [n, 3, S, S] in [-1, 1], prompts)``."""
    rows = _split()[split]
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    by_tag = {t: [r for r in rows if r["tag"] == t] for t in tags}
    picked = [by_tag[tags[generator.integers(len(tags))]] for _ in range(n)]
    picked = [rs[generator.integers(len(rs))] for rs in picked]
    scenes = [scene_for(r, generator, image_size) for r in picked]
    return render(scenes, image_size), [r["prompt"] for r in picked]


# ---------------------------------------------------------------- the shipped prompt sets
SET_NAMES = {"train": "shapes-train", "heldout": "shapes", "all": "shapes-geneval"}  # split -> shipped set name
SET_FILES = {split: NAMED[name] for split, name in SET_NAMES.items()}  # split -> file under flowrl/data/prompt_sets


def write_shapes_sets(directory) -> list:
    """Write :func:`shapes_rows` of each split as GenEval metadata ``.jsonl`` (one row a line) under
    ``directory``: the shipped ``shapes-train``, ``shapes`` and ``shapes-geneval`` prompt sets
    (``flowrl/data/prompt_sets``; a test checks they equal the rows). Returns the paths written."""
    import json
    from pathlib import Path

    out = []
    for split, name in SET_FILES.items():
        p = Path(directory) / name
        p.write_text("".join(json.dumps(r) + "\n" for r in shapes_rows(split)), encoding="utf-8")
        out.append(p)
    return out
