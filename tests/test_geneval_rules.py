"""GenEval's rules on hand-built detections: every tag, the threshold edges (strictly above 0.3, 0.9
for counting), the per-class limit, the ordering, the position rule, Flow-GRPO's partial score,
the summary (mean over tags) and the metadata checks."""
import json

import numpy as np
import pytest

from flowrl.errors import ConfigError
from flowrl.rewards.geneval_rules import (Rules, check_metadata, compute_iou, evaluate, evaluate_partial,
                                          relative_position, select_objects, summary)
from flowrl.rewards.geneval import metadata_table, shipped_metadata_path


def det(x0, y0, x1, y1, score, mask=None):
    return (np.array([x0, y0, x1, y1, score], dtype=float), mask)


def no_colors(name, dets):
    raise AssertionError("colour asked for a clause without a colour or with its count unmet")


def paint(**by_class):
    """A colour callback: each class's detections get the listed colours in order."""
    calls = []

    def colors(name, dets):
        calls.append((name, len(dets)))
        return list(by_class[name])[:len(dets)]
    colors.calls = calls
    return colors


def verdict(meta, raw, colors=no_colors, rules=Rules()):
    return evaluate(select_objects(raw, meta["tag"], rules), meta, colors, rules)[0]


SINGLE = {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
TWO = {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}]}
COUNT = {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}]}
COLOR = {"tag": "colors", "include": [{"class": "fire hydrant", "count": 1, "color": "blue"}]}
POSITION = {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                           {"class": "dog", "count": 1, "position": ["right of", 0]}]}
ATTR = {"tag": "color_attr", "include": [{"class": "handbag", "count": 1, "color": "pink"},
                                         {"class": "scissors", "count": 1, "color": "black"}]}


def test_single_object_threshold_is_strictly_above_0_3():
    assert verdict(SINGLE, {"bench": [det(0, 0, 9, 9, 0.31)]})
    assert not verdict(SINGLE, {"bench": [det(0, 0, 9, 9, 0.30)]})  # > 0.3, not >=
    assert not verdict(SINGLE, {"bench": []}) and not verdict(SINGLE, {"dog": [det(0, 0, 9, 9, 0.99)]})


def test_two_objects_need_both():
    assert verdict(TWO, {"bench": [det(0, 0, 9, 9, 0.5)], "sports ball": [det(20, 0, 29, 9, 0.4)]})
    assert not verdict(TWO, {"bench": [det(0, 0, 9, 9, 0.5)], "sports ball": [det(20, 0, 29, 9, 0.2)]})


def test_counting_uses_0_9_and_the_exclude_clause():
    two = [det(0, 0, 9, 9, 0.95), det(20, 0, 29, 9, 0.91)]
    assert verdict(COUNT, {"clock": two})
    assert not verdict(COUNT, {"clock": [two[0], det(20, 0, 29, 9, 0.90)]})  # 0.9 itself does not count
    assert verdict(COUNT, {"clock": [*two, det(40, 0, 49, 9, 0.85)]})  # a third below 0.9 is not seen
    assert not verdict(COUNT, {"clock": [*two, det(40, 0, 49, 9, 0.92)]})  # three: excluded
    # the same 0.85 detection counts for a non-counting tag (threshold 0.3)
    assert verdict(SINGLE, {"bench": [det(0, 0, 9, 9, 0.85)]})


def test_at_most_16_objects_per_class_and_the_most_confident_first():
    many = [det(i * 10, 0, i * 10 + 5, 5, 0.95 + i * 1e-3) for i in range(20)]
    kept = select_objects({"clock": many}, "counting")
    assert len(kept["clock"]) == 16
    assert [d[0][4] for d in kept["clock"]] == sorted((d[0][4] for d in many), reverse=True)[:16]
    seventeen = {"tag": "counting", "include": [{"class": "clock", "count": 2}],
                 "exclude": [{"class": "clock", "count": 17}]}
    assert verdict(seventeen, {"clock": many})  # the limit: 17 can never be reached


def test_overlap_suppression_is_off_by_default_and_optional():
    overlapping = [det(0, 0, 10, 10, 0.9), det(1, 1, 11, 11, 0.8)]
    assert len(select_objects({"cat": overlapping}, "two_object")["cat"]) == 2  # max_overlap 1.0: off
    assert len(select_objects({"cat": overlapping}, "two_object", Rules(max_overlap=0.5))["cat"]) == 1
    assert compute_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert compute_iou([0, 0, 9, 9], [10, 0, 19, 9]) == 0.0  # inclusive pixels: touching is not overlapping
    assert compute_iou([0, 0, 9, 9], [9, 0, 18, 9]) == pytest.approx(10 / 190)


def test_colour_needs_every_counted_object_in_the_colour():
    hydrant = {"fire hydrant": [det(0, 0, 9, 9, 0.9)]}
    assert verdict(COLOR, hydrant, paint(**{"fire hydrant": ["blue"]}))
    assert not verdict(COLOR, hydrant, paint(**{"fire hydrant": ["red"]}))
    assert not verdict(COLOR, {}, no_colors)  # count unmet: no colour asked
    two_blue = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "blue"}]}
    cars = {"car": [det(0, 0, 9, 9, 0.9), det(20, 0, 29, 9, 0.8), det(40, 0, 49, 9, 0.7)]}
    c = paint(car=["blue", "red", "blue"])
    assert not verdict(two_blue, cars, c)  # judged on the 2 most confident only: blue, red
    assert c.calls == [("car", 2)]


@pytest.mark.parametrize("dog, relations", [
    ((30, 0, 40, 10), {"right of"}),
    ((12, 0, 22, 10), {"right of"}),          # offset 12 > 0.1 x (10 + 10): still right of
    ((1, 0, 11, 10), set()),                  # offset 1 < 2: no relation at all
    ((10, 10, 20, 20), {"right of", "below"}),  # diagonal: both components above half the offset
    ((10, 20, 20, 30), {"below"}),            # mostly below: right of no longer holds
    ((-30, -30, -20, -20), {"left of", "above"}),
])
def test_position_rule(dog, relations):
    teddy = det(0, 0, 10, 10, 0.9)
    assert relative_position(det(*dog, 0.9), teddy) == relations
    assert verdict(POSITION, {"teddy bear": [teddy], "dog": [det(*dog, 0.9)]}) == ("right of" in relations)


def test_position_needs_a_target_that_passed_and_every_pair():
    dog = det(30, 0, 40, 10, 0.9)
    assert not verdict(POSITION, {"dog": [dog]})  # no teddy bear: no target
    two_teddies = {"tag": "position", "include": [{"class": "teddy bear", "count": 2},
                                                  {"class": "dog", "count": 1, "position": ["right of", 0]}]}
    left, right_of_dog = det(0, 0, 10, 10, 0.9), det(60, 0, 70, 10, 0.8)
    assert not verdict(two_teddies, {"teddy bear": [left, right_of_dog], "dog": [dog]})  # right of one, not both
    assert verdict(two_teddies, {"teddy bear": [left, det(5, 0, 15, 10, 0.8)], "dog": [dog]})


def test_color_attribution_binds_each_colour_to_its_object():
    raw = {"handbag": [det(0, 0, 9, 9, 0.9)], "scissors": [det(20, 0, 29, 9, 0.9)]}
    assert verdict(ATTR, raw, paint(handbag=["pink"], scissors=["black"]))
    assert not verdict(ATTR, raw, paint(handbag=["black"], scissors=["pink"]))  # swapped colours


def test_flow_grpo_partial_score():
    three = {"clock": [det(i * 20, 0, i * 20 + 9, 9, 0.95) for i in range(3)]}
    strict, score = evaluate_partial(select_objects(three, "counting"), COUNT, no_colors)
    assert not strict and score == pytest.approx(0.5)  # 1 - |2 - 3| / 2; exclude ignored
    five = {"clock": [det(i * 20, 0, i * 20 + 9, 9, 0.95) for i in range(5)]}
    assert evaluate_partial(select_objects(five, "counting"), COUNT, no_colors)[1] == pytest.approx(-0.5)
    raw = {"teddy bear": [det(0, 0, 10, 10, 0.9)], "dog": [det(1, 0, 11, 10, 0.9)]}
    strict, score = evaluate_partial(select_objects(raw, "position"), POSITION, no_colors)
    assert not strict and score == pytest.approx((1 + 1 + 0 + 1) / 4)  # the reference's 0.0 then 1.0
    strict, score = evaluate_partial(select_objects({"fire hydrant": []}, "colors"), COLOR, no_colors)
    assert not strict and score == 0.0  # count term 0 and the colour term 0


def test_summary_is_the_mean_over_tags():
    s = summary(["counting", "counting", "counting", "colors"], [1.0, 1.0, 0.0, 0.0])
    assert s["tags"] == {"counting": pytest.approx(2 / 3), "colors": 0.0}
    assert s["overall"] == pytest.approx(1 / 3)  # not 2/4 (the image mean)
    assert list(s["tags"]) == ["counting", "colors"]  # order of first appearance, as summary_scores.py
    assert s["unscored"] == []
    part = summary(["counting", "counting", "colors"], [1.0, 0.0, float("nan")])  # no colors image scored
    assert part["unscored"] == ["colors"] and np.isnan(part["tags"]["colors"]) and np.isnan(part["overall"])
    assert part["tags"]["counting"] == 0.5 and part["images"] == 2  # not an "overall" of counting alone


def test_shipped_metadata_is_geneval_s_553_prompts():
    table = metadata_table(str(shipped_metadata_path()))
    assert len(table) == 553
    tags = [r["tag"] for r in table.values()]
    assert {t: tags.count(t) for t in set(tags)} == {"position": 100, "color_attr": 100, "two_object": 99,
                                                     "colors": 94, "single_object": 80, "counting": 80}
    assert table["a photo of a dog right of a teddy bear"]["include"][1]["position"] == ["right of", 0]


@pytest.mark.parametrize("row, match", [
    ({"tag": "counting", "prompt": "two clocks"}, r"tag 'counting' without its 'include' clauses"),
    ({"tag": "colors", "include": []}, r"without its 'include' clauses"),
    ({"include": [{"class": "clock", "count": 2}]}, r"need a 'tag'"),
    ({"tag": "counting", "include": [{"class": "clock", "count": 0}]}, r"'count' must be a positive integer"),
    ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "teal"}]}, r"color 'teal' is not one of"),
    ({"tag": "position", "include": [{"class": "dog", "count": 1, "position": ["right of", 0]}]},
     r"position must be \[relation, index of an earlier include clause\]"),
    ({"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1,
                                                                    "position": ["beside", 0]}]}, r"among left of"),
])
def test_a_row_without_its_clauses_is_a_one_line_error(row, match):
    with pytest.raises(ConfigError, match=match):
        check_metadata(row, "suite.jsonl:3")


def test_a_metadata_file_names_the_bad_row(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"prompt": "a", **SINGLE}) + "\n" + json.dumps({"prompt": "b", "tag": "counting"}) + "\n")
    with pytest.raises(ConfigError, match=r"m\.jsonl:2: tag 'counting' without"):
        metadata_table(str(p))
