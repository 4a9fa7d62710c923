"""Prompt items that carry a source image (flowrl.data.items), the shipped digits editing set
(flowrl.data.digits_edit), and FLUX.1 Kontext taking their texts and sources separately (flowrl.conditions)."""
import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.data.digits_edit import IMAGE_DIR, SAMPLE_FILE, digits_edit_rows, write_digits_edit_set
from flowrl.data.items import PromptItem, as_items, item_sources, item_texts, load_edit_set, load_image
from flowrl.data.prompts import SETS_DIR


def _png(path, array) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path)


def test_image_loading_and_the_key(tmp_path):
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10  # [H, W, 3]
    _png(tmp_path / "a.png", rgb)
    img = load_image(tmp_path / "a.png")
    assert img.dtype == torch.float32 and img.shape == (3, 2, 3)
    assert torch.equal(img, torch.tensor(rgb).permute(2, 0, 1).float() / 255)
    _png(tmp_path / "grey.png", rgb[..., 0])  # greyscale -> RGB, three equal channels
    grey = load_image(tmp_path / "grey.png")
    assert grey.shape == (3, 2, 3) and torch.equal(grey[0], grey[2])

    by_path, by_tensor = PromptItem("make it red", tmp_path / "a.png"), PromptItem("make it red", img.clone())
    assert by_path.key == by_tensor.key and by_path == by_tensor and hash(by_path) == hash(by_tensor)
    assert by_path.key.startswith("make it red\x1fsha256:") and len(by_path.key.split(":")[-1]) == 16
    assert torch.equal(by_path.image, img) and by_path.has_source
    other = img.clone()
    other[0, 0, 0] = 1.0
    assert PromptItem("make it red", other).key != by_path.key  # one changed pixel: another key
    assert PromptItem("make it blue", img).key != by_path.key
    # a text-only item keys as its plain prompt; meta is not part of the identity
    text = PromptItem("a cat", meta={"tag": 1})
    assert text.key == "a cat" and text.image is None and text == PromptItem("a cat") and not text.has_source
    assert {by_path: 1, by_tensor: 2} == {by_path: 2}  # usable as dict keys
    assert "tensor(3, 2, 3)" in repr(by_tensor) and "a.png" in repr(by_path)

    back = pickle.loads(pickle.dumps(by_path))  # pickles without its decoded image, reloads on demand
    assert "image" not in pickle.loads(pickle.dumps(by_path)).__dict__ and back == by_path
    assert torch.equal(back.image, img) and back.meta == {}


def test_item_errors():
    with pytest.raises(TypeError, match="prompt must be a str"):
        PromptItem(3)
    with pytest.raises(ValueError, match=r"float \[3, H, W\]"):
        PromptItem("x", torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        PromptItem("x", torch.full((3, 2, 2), 2.0))
    with pytest.raises(TypeError, match="source must be None, a path"):
        PromptItem("x", 5)
    with pytest.raises(TypeError, match="meta must be a dict"):
        PromptItem("x", meta=[1])
    with pytest.raises(FileNotFoundError, match="nope.png not found"):
        PromptItem("x", "nope.png").image
    with pytest.raises(TypeError, match="prompt 1 is int"):
        as_items(["a", 1])


def test_as_items_texts_and_sources():
    src = torch.rand(3, 4, 4)
    items = as_items(["a cat", PromptItem("edit it", src)])
    assert [type(i) for i in items] == [PromptItem, PromptItem] and items[1].source is src
    assert item_texts(items) == item_texts(["a cat", items[1]]) == ["a cat", "edit it"]
    sources = item_sources(items)
    assert sources[0] is None and torch.equal(sources[1], src)


def _edit_set(tmp_path, rows) -> str:
    path = tmp_path / "set" / "edits.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_edit_set_and_its_errors(tmp_path):
    _png(tmp_path / "set" / "img" / "a.png", np.zeros((4, 4, 3)))
    (tmp_path / "set" / "img" / "bad.png").write_bytes(b"not a png")
    path = _edit_set(tmp_path, [{"prompt": "make it red", "image": "img/a.png", "tag": "color"}, "",
                                {"instruction": "add a hat", "image": "img/a.png"}])
    items = load_edit_set(path)
    assert [i.prompt for i in items] == ["make it red", "add a hat"]
    assert items[0].source == (tmp_path / "set" / "img" / "a.png").resolve()  # relative to the .jsonl
    assert items[0].meta == {"tag": "color"} and items[1].meta == {}
    assert items[0].image.shape == (3, 4, 4)

    cases = [
        ([{"image": "img/a.png"}], r"edits.jsonl:1: missing field prompt \(or instruction\)"),
        ([{"prompt": "x"}], "edits.jsonl:1: missing field image"),
        ([{"prompt": "x", "image": "img/a.png"}, {"prompt": "y", "image": "img/gone.png"}],
         r"edits.jsonl:2: source image .*gone.png not found"),
        ([{"prompt": "x", "image": "img/bad.png"}], r"edits.jsonl:1: source image .*bad.png is not a readable image"),
        (["{oops"], "edits.jsonl:1: not valid JSON"),
        ([{"prompt": "", "image": "img/a.png"}], "field 'prompt' must be a non-empty string"),
        ([[1, 2]], "a row must be a JSON object"),
        ([""], "is empty"),
    ]
    for rows, message in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            load_edit_set(_edit_set(tmp_path, rows))
    assert len(load_edit_set(_edit_set(tmp_path, [{"prompt": "x", "image": "img/gone.png"}]), check_images=False)) == 1
    with pytest.raises(FileNotFoundError, match="editing prompt set .*missing.jsonl not found"):
        load_edit_set(tmp_path / "missing.jsonl")


def test_shipped_digits_edit_set_is_what_the_writer_makes(tmp_path):
    write_digits_edit_set(tmp_path)
    assert (tmp_path / SAMPLE_FILE).read_text() == (SETS_DIR / SAMPLE_FILE).read_text()
    made = sorted(p.name for p in (tmp_path / IMAGE_DIR).iterdir())
    assert made == sorted(p.name for p in (SETS_DIR / IMAGE_DIR).iterdir()) and len(made) == 10
    for name in made:  # decoded pixels, exactly (PNG bytes may differ between zlib builds)
        assert np.array_equal(np.asarray(Image.open(tmp_path / IMAGE_DIR / name)),
                              np.asarray(Image.open(SETS_DIR / IMAGE_DIR / name))), name
    total = sum(p.stat().st_size for p in (SETS_DIR / IMAGE_DIR).iterdir()) + (SETS_DIR / SAMPLE_FILE).stat().st_size
    assert total < 8 * 1024  # tiny: it ships in the wheel

    items = load_edit_set(SETS_DIR / SAMPLE_FILE)
    rows = digits_edit_rows()
    assert len(items) == len(rows) == 14 and items[3].prompt == "turn this 3 into an 8"
    assert items[3].meta == {"source_digit": 3, "target_digit": 8}
    img = items[3].image  # a 3, bright strokes on black, 16 x 16
    assert img.shape == (3, 16, 16) and torch.equal(img[0], img[1]) and img.max() > 0.9 and img[:, 0, 0].max() < 0.1
    assert items[10].image is not items[0].image and torch.equal(items[10].image, items[0].image)  # same source file


def test_kontext_takes_texts_and_sources_separately():
    """The conditions seam is the one parser of prompt items: Kontext gets the texts in ``encode_prompts``
    and the sources in ``source_conditioning``, never an item."""
    from flowrl.conditions import encode_conditions
    from flowrl.pipelines.flux_kontext import FluxKontextPolicy
    from flowrl.pipelines.tiny import tiny_pipeline

    policy = FluxKontextPolicy(tiny_pipeline("flux-kontext", image_size=32), max_sequence_length=8, resolution=32)
    items = load_edit_set(SETS_DIR / SAMPLE_FILE)[:2]
    seen = []
    encode, source = policy.encode_prompts, policy.source_conditioning
    policy.encode_prompts = lambda texts: seen.append(("text", texts)) or encode(texts)
    policy.source_conditioning = lambda texts, sources: seen.append(("sources", texts, sources)) or source(texts, sources)
    cond = encode_conditions(policy, items)
    texts = [i.prompt for i in items]
    assert seen[0] == ("text", texts) and seen[1][:2] == ("sources", texts)
    assert all(len(s) == 1 and torch.equal(s[0], i.image) for s, i in zip(seen[1][2], items))
    ref = {**encode(texts), "image_latents": policy.encode_sources([i.image for i in items])}
    assert cond["image_latents"].shape == (2, 16, 4, 4)
    assert cond.keys() == ref.keys() and all(torch.equal(cond[k], ref[k]) for k in cond)
    text = encode_conditions(policy, as_items(["a cat", "a dog"]))  # text-only items: text-to-image
    assert "image_latents" not in text
    assert torch.equal(text["prompt_embeds"], encode(["a cat", "a dog"])["prompt_embeds"])
