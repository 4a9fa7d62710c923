"""The shapes world's shipped prompt sets (shapes-train, shapes, shapes-geneval), its suites and the
geneval reward's ``metadata: shapes``: the files are shapes_rows() exactly, and a recipe naming them
passes --smoke's checks."""
import json

import pytest

from flowrl.data.prompts import NAMED, SETS_DIR, load_prompts
from flowrl.data.shapes import SET_FILES, shapes_rows, write_shapes_sets
from flowrl.errors import ConfigError
from flowrl.eval.suites import load_suite
from flowrl.rewards.geneval_rules import TAGS


def test_shipped_files_are_the_rows(tmp_path):
    for split, name in SET_FILES.items():
        rows = [json.loads(ln) for ln in (SETS_DIR / name).read_text(encoding="utf-8").splitlines()]
        assert rows == shapes_rows(split), f"regenerate: write_shapes_sets('{SETS_DIR}')"
    assert {NAMED[n] for n in ("shapes-train", "shapes", "shapes-geneval")} == set(SET_FILES.values())
    written = write_shapes_sets(tmp_path)
    assert [p.read_bytes() for p in written] == [(SETS_DIR / p.name).read_bytes() for p in written]


def test_prompt_sets_and_suites():
    assert load_prompts("shapes-train") == [r["prompt"] for r in shapes_rows("train")]
    assert load_prompts("shapes") == [r["prompt"] for r in shapes_rows("heldout")]
    suite = load_suite("shapes")
    assert len(suite.items) == 21 and set(suite.tags) == set(TAGS)
    for item, row in zip(suite.items, shapes_rows("heldout")):
        assert item.text == row["prompt"] and item.tag == row["tag"]
        assert item.meta["include"] == row["include"] and item.meta["exclude"] == row.get("exclude", [])
    assert len(load_suite("shapes-geneval").items) == 230


def test_metadata_shapes_finds_every_shapes_prompt_and_smoke_takes_the_name():
    from flowrl.rewards import build
    from flowrl.smoke import _check_reward_files

    r = build("geneval", detector="test_geneval_reward:top_left_detector", metadata="shapes")
    assert all(r.table[row["prompt"]]["include"] == row["include"] for row in shapes_rows())
    assert "a photo of a dog" in r.table  # GenEval's own rows stay
    _check_reward_files("reward.options", "geneval", {"metadata": "shapes"})  # a built-in name, not a file
    _check_reward_files("reward.options", "geneval", {"metadata": ["shapes", str(SETS_DIR / NAMED["geneval"])]})
    with pytest.raises(ConfigError, match=r"metadata=no_such_shapes.jsonl is no file here"):
        _check_reward_files("reward.options", "geneval", {"metadata": "no_such_shapes.jsonl"})
