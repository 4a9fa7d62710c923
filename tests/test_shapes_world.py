"""The shapes world's prompts and scenes (flowrl.data.shapes): GenEval rows, a fixed split, and scenes
that satisfy their row under GenEval's own rules when judged on their true boxes and colours."""
import collections

import numpy as np
import pytest

from flowrl.data.shapes import (BACKGROUND, HELDOUT_PER_TAG, PALETTE, IMAGE_SIZE, Scene, extent, render, scene_for, shapes_batch,
                                shapes_rows)
from flowrl.rewards.geneval_rules import TAGS, check_metadata, evaluate, select_objects


def test_rows_are_geneval_rows_of_all_six_tags_with_a_disjoint_heldout_split():
    rows = shapes_rows()
    assert {r["tag"] for r in rows} == set(TAGS)
    for r in rows:
        check_metadata(r, r["prompt"])
    train, held = shapes_rows("train"), shapes_rows("heldout")
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert len(train) + len(held) == len(rows) == len({r["prompt"] for r in rows})
    held_per_tag = collections.Counter(r["tag"] for r in held)
    every = collections.Counter(r["tag"] for r in rows)
    # every tag held out about as often (HELDOUT_PER_TAG, at most half of a tag), and some of each tag trained on
    assert held_per_tag == {t: min(HELDOUT_PER_TAG, every[t] // 2) for t in TAGS}, held_per_tag
    assert set(held_per_tag.values()) == {2, 3, 4}
    assert shapes_rows("heldout") == held  # fixed
    with pytest.raises(ValueError, match="split must be"):
        shapes_rows("test")


def _truth(scene: Scene) -> tuple[dict, dict]:
    """GenEval detections from the scene's own boxes and masks (score 1), and each mask's colour."""
    dets, colors = collections.defaultdict(list), {}
    for o, m in zip(scene.objects, scene.masks()):
        box = np.array([*extent(m), 1.0])
        dets[o.kind].append((box, m))
        colors[id(m)] = o.color
    return dets, colors


def test_every_scene_satisfies_its_row_under_genevals_rules():
    g = np.random.default_rng(0)
    for r in shapes_rows():
        scene = scene_for(r, g)
        dets, colors = _truth(scene)
        ok, reason = evaluate(select_objects(dets, r["tag"]), r, lambda cls, found: [colors[id(d[1])] for d in found])
        assert ok, (r["prompt"], reason)
        masks = scene.masks()
        assert all(m.any() for m in masks)
        assert sum(m.sum() for m in masks) == np.logical_or.reduce(masks).sum()  # no two objects share a pixel


def test_render_is_the_palette_on_the_background():
    g = np.random.default_rng(1)
    x, prompts = shapes_batch(8, g)
    assert x.shape == (8, 3, IMAGE_SIZE, IMAGE_SIZE) and len(prompts) == 8
    pixels = {tuple(v) for v in ((x.permute(0, 2, 3, 1).reshape(-1, 3) + 1) * 127.5).round().int().tolist()}
    assert pixels <= {BACKGROUND, *PALETTE.values()} and BACKGROUND in pixels
    assert render([scene_for(shapes_rows()[0], np.random.default_rng(2))]).equal(
        render([scene_for(shapes_rows()[0], np.random.default_rng(2))]))  # a seed is a scene
