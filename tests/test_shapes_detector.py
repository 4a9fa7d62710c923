"""The shapes world's detector and colour reader (flowrl.rewards.shapes_detector): exact on renders of
every prompt's scene, sensible on noisy and blurred ones, and GenEval's reward on them agreeing with
GenEval's verdict on the scenes' true objects (right scene 1.0, another prompt's scene as its truth)."""
import collections

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowrl.data.shapes import PALETTE, Scene, Shape, render, scene_for, shapes_rows
from flowrl.errors import ConfigError
from flowrl.rewards import build
from flowrl.rewards.geneval_detectors import check_detections
from flowrl.rewards.geneval_rules import evaluate, evaluate_partial, select_objects
from flowrl.rewards.shapes_detector import PaletteColors, ShapesDetector, extent

DETECTOR = "flowrl.rewards.shapes_detector:ShapesDetector"
COLORS = "flowrl.rewards.shapes_detector:PaletteColors"


def scenes_of(rows, seed):
    g = np.random.default_rng(seed)
    return [scene_for(r, g) for r in rows]


def unit(scenes) -> torch.Tensor:
    return (render(scenes) + 1) / 2  # [B, 3, S, S] in [0, 1]


def kinds(per: dict) -> list:
    return sorted(k for k, v in per.items() for _ in v)


def test_detections_are_the_scene_objects_exactly_on_renders_of_every_row():
    rows = shapes_rows()
    scenes = scenes_of(rows, 0)
    out = ShapesDetector()(unit(scenes))
    check_detections(out, len(scenes), 32, 32, "shapes")
    for scene, per in zip(scenes, out):
        got = sorted((k, tuple(d[:4]), d[5].tobytes()) for k, v in per.items() for d in v)
        want = sorted((o.kind, tuple(float(c) for c in extent(m)), m.tobytes())
                      for o, m in zip(scene.objects, scene.masks()))
        assert got == want
        assert all(d[4] > 0.9 for v in per.values() for d in v)  # passes the counting threshold


def test_noise_and_blur_keep_the_objects_and_a_smudge_scores_low():
    rows = shapes_rows()[::3]
    scenes = scenes_of(rows, 1)
    x = unit(scenes)
    noisy = (x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    k = torch.exp(-torch.arange(-2, 3.0) ** 2 / (2 * 0.5 ** 2))
    k = (k[:, None] * k[None] / k.sum() ** 2).expand(3, 1, 5, 5)  # a Gaussian blur, sigma 0.5 pixels
    blurred = F.conv2d(F.pad(x, (2, 2, 2, 2), mode="replicate"), k, groups=3)
    for images in (noisy, blurred):
        out = ShapesDetector()(images)
        assert [kinds(p) for p in out] == [sorted(o.kind for o in s.objects) for s in scenes]
        assert min(d[4] for p in out for v in p.values() for d in v) > 0.9
    # two touching red shapes are one component that no template covers; a speck is noise
    smudge = Scene((Shape("square", "red", 10, 12, 10), Shape("circle", "red", 17, 14, 9), Shape("square", "blue", 28, 28, 2)))
    (per,) = ShapesDetector()(unit([smudge]))
    assert sum(len(v) for v in per.values()) == 1 and next(iter(per.values()))[0][4] < 0.85


def test_palette_colours_read_each_object_s_colour():
    rows = [r for r in shapes_rows() if r["tag"] in ("color_attr", "counting")][:40]
    scenes = scenes_of(rows, 2)
    x = unit(scenes)
    pixels = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # [B, S, S, 3]
    colors = PaletteColors()
    for scene, image, per in zip(scenes, pixels, ShapesDetector()(x)):
        want = collections.Counter((o.kind, o.color) for o in scene.objects)
        dets = [(np.array(d[:5]), d[5]) for v in per.values() for d in v]
        names = [k for k, v in per.items() for _ in v]
        assert collections.Counter(zip(names, colors(image, "", dets))) == want
        boxes = [(box, None) for box, _ in dets]  # no mask: the box's pixels vote
        assert collections.Counter(zip(names, colors(image, "", boxes))) == want
    blank = np.full((8, 8, 3), 235, np.uint8)
    assert colors(blank, "circle", [(np.array([0, 0, 8, 8, 1.0]), None)]) == ["white"]
    assert set(PALETTE) <= {"red", "green", "blue", "yellow"}


def _truth(scene: Scene) -> tuple[dict, dict]:
    """GenEval detections from the scene's own objects (score 1) and each mask's colour."""
    dets, colors = collections.defaultdict(list), {}
    for o, m in zip(scene.objects, scene.masks()):
        dets[o.kind].append((np.array([*extent(m), 1.0]), m))
        colors[id(m)] = o.color
    return dets, colors


def test_geneval_with_the_shapes_detector_scores_every_row_by_the_official_rules():
    """Each row's own render scores 1.0; the render of the next row of its tag (another count, class,
    colour or relation) scores what GenEval's rules give on that scene's true objects, 0.0 for most."""
    rows = shapes_rows()
    r = build("geneval", detector=DETECTOR, colors=COLORS, metadata="shapes")
    partial = build("geneval", detector=DETECTOR, colors=COLORS, metadata="shapes", score="partial")
    prompts = [row["prompt"] for row in rows]
    own = scenes_of(rows, 3)
    assert r(unit(own), prompts).tolist() == [1.0] * len(rows)  # the clauses found from the text alone
    by_tag = collections.defaultdict(list)
    for i, row in enumerate(rows):
        by_tag[row["tag"]].append(i)
    other = [by_tag[row["tag"]][(by_tag[row["tag"]].index(i) + 1) % len(by_tag[row["tag"]])]
             for i, row in enumerate(rows)]
    swapped = [own[j] for j in other]
    got, got_partial = r(unit(swapped), prompts), partial(unit(swapped), prompts)
    for i, scene in enumerate(swapped):
        dets, colors = _truth(scene)
        def colors_of(cls, found):
            return [colors[id(d[1])] for d in found]
        want = float(evaluate(select_objects(dets, rows[i]["tag"]), rows[i], colors_of)[0])
        want_partial = evaluate_partial(select_objects(dets, rows[i]["tag"]), rows[i], colors_of)[1]
        assert got[i].item() == want, rows[i]["prompt"]
        assert got_partial[i].item() == pytest.approx(want_partial)
    assert (got == 0).float().mean() > 0.8  # most swaps break a clause
    between = got_partial[(got_partial > 0) & (got_partial < 1)]
    assert len(between) > 50  # partial credit: e.g. the count right, the colour wrong


def test_colours_option_builds_what_it_names():
    r = build("geneval", detector=DETECTOR, colors="test_shapes_detector:always_red")
    x = unit(scenes_of([{"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "green"}]}], 4))
    assert r(x, ["a green circle"], metadata=[{"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}]}]).item() == 1.0
    built = build("geneval", detector=DETECTOR, colors="test_shapes_detector:Recorder", bgcolor="#123")
    built(x, ["a photo of a green circle"], metadata=[{"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "green"}]}])
    assert built._colors.seen == {"bgcolor": "#123", "device": "cpu"}
    from flowrl.rewards.geneval_colors import ClipColors

    assert build("geneval", detector=DETECTOR).colors_target is ClipColors  # the default: CLIP, built lazily
    with pytest.raises(ConfigError, match=r"colors must be 'module:callable'"):
        build("geneval", detector=DETECTOR, colors="palette")


def test_detector_options_are_typed():
    assert build("geneval", detector=DETECTOR, detector_options={"min_area": 4}).detector.min_area == 4
    with pytest.raises(ConfigError, match=r"detector_options.max_distanc: not an option .* Did you mean "
                                          r"reward.options.geneval.detector_options.max_distance\?"):
        build("geneval", detector=DETECTOR, detector_options={"max_distanc": 3})
    with pytest.raises(ConfigError, match=r"detector_options.min_area must be an integer >= 1, got 0"):
        build("geneval", detector=DETECTOR, detector_options={"min_area": 0})


def always_red(image, class_name, detections):
    return ["red"] * len(detections)


class Recorder:
    """A colour classifier class that takes two of the offered settings."""

    def __init__(self, bgcolor: str, device: str = "?"):
        self.seen = {"bgcolor": bgcolor, "device": device}

    def __call__(self, image, class_name, detections):
        return ["green"] * len(detections)
