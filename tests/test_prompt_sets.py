"""Prompt sets: shipped samples by name, Hugging Face datasets saved to disk (Dataset and
DatasetDict, column and split choice), and the errors for each way of getting it wrong."""
import json

import pytest

from flowrl.data.prompts import NAMED, SETS_DIR, available_sets, load_prompts
from flowrl.trainers.config import load_config



def _datasets():
    import datasets  # in requirements.lock (flowrl[data]); a core path of load_prompts, never skipped

    return datasets


@pytest.mark.parametrize("name, n, first_word", [("flowgrpo-ocr-sample", 32, "A"), ("flowgrpo-pickscore-sample", 36, "gold"),
                                                  ("geneval-sample", 30, "a"), ("digits", 10, "a")])
def test_shipped_sets_load_by_name(name, n, first_word):
    prompts = load_prompts(name)
    assert len(prompts) == n and len(set(prompts)) == n
    assert prompts[0].split()[0] == first_word and all(p == p.strip() and p for p in prompts)


def test_shipped_files_are_documented_and_geneval_keeps_its_metadata():
    readme = (SETS_DIR / "README.md").read_text()
    for name, f in NAMED.items():
        assert name in readme and f in readme and (SETS_DIR / f).is_file()
    recs = [json.loads(l) for l in (SETS_DIR / NAMED["geneval-sample"]).read_text().splitlines()]
    assert {r["tag"] for r in recs} == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    assert set(available_sets()) >= {"digits", *NAMED}


def test_every_set_in_the_readme_table_loads_with_its_documented_count():
    """Each row of prompt_sets/README.md's table (| `name` | `file` | lines | ...) loads by name to that many
    prompts, and every shipped name has a row."""
    import re

    rows = re.findall(r"^\| `([\w-]+)` \| [^|]+ \| (\d+) \|", (SETS_DIR / "README.md").read_text(), re.M)
    assert {name for name, _ in rows} >= set(NAMED) - {"digits-edit-sample", "digits-edit-multi-sample"}
    for name, n in rows:
        assert len(load_prompts(name)) == int(n), name


def test_a_missing_recipe_file_says_where_to_get_it(tmp_path, monkeypatch):
    """The real run's error for a recipe's prompt file that is not here quotes the recipe's data.source."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config("sd3_group_pickscore")
    with pytest.raises(FileNotFoundError, match=r"prompt file 'data/pickscore/train\.txt' not found.*The recipe's "
                                                r"prompt files come from \(data\.source\): Flow-GRPO's dataset/pickscore"):
        cfg.data.train_prompts()
    assert len(load_config("sd3_gdro_ocr").data.eval_prompt_set()) == 1018  # shipped: flowgrpo-ocr-test


def test_hf_dataset_on_disk(tmp_path):
    datasets = _datasets()
    ds = datasets.Dataset.from_dict({"caption": ["a cat", "a dog"], "id": [1, 2]})
    ds.save_to_disk(str(tmp_path / "flat"))
    assert load_prompts(str(tmp_path / "flat")) == ["a cat", "a dog"]  # 'caption' found without being named
    with pytest.raises(ValueError, match=r"no prompt column 'title'.*columns are \['caption', 'id'\]"):
        load_prompts(str(tmp_path / "flat"), column="title")
    with pytest.raises(ValueError, match="without splits"):
        load_prompts(str(tmp_path / "flat"), split="test")


def test_hf_dataset_dict_splits_through_the_config(tmp_path):
    datasets = _datasets()
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t1", "t2", "t3"]}),
                               "test": datasets.Dataset.from_dict({"text": ["e1", "e2"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = load_config("recipes/digits.yaml", [f"data.prompts={tmp_path / 'dd'}", f"data.eval_prompts={tmp_path / 'dd'}",
                                              "data.eval_prompt_split=test", "data.prompt_column=text"])
    assert cfg.data.train_prompts() == ["t1", "t2", "t3"]
    assert cfg.data.eval_prompt_set() == ["e1", "e2"]
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\].*'valid' is not among them"):
        load_prompts(str(tmp_path / "dd"), split="valid")


def test_directory_that_is_not_a_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="not a saved Hugging Face dataset"):
        load_prompts(str(tmp_path / "d"))


def test_jsonl_column_choice(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"caption": "x", "prompt": "y"}\n{"caption": "z", "prompt": "w"}\n')
    assert load_prompts(str(p)) == ["y", "w"]
    assert load_prompts(str(p), column="caption") == ["x", "z"]
