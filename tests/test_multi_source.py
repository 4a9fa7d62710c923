"""Several source images per prompt (issue: one to three, in order): prompt items and editing rows with a
list of images, the shipped multi-source sample and the ``digits_edit`` instructions that need every
source in order, every sampler / the evaluation / the offline dataset / the remote reward / the VLM
judge carrying all of them in order, and one-source rows unchanged (same key, same payload, same
reward). The Qwen-Image-Edit model trained on this set is in tests/test_qwen_image_edit.py."""
import json
import pickle

import pytest
import torch

from flowrl.conditions import prompt_parts, reward_inputs
from flowrl.data import load_prompts
from flowrl.data.digits_edit import MULTI_SAMPLE_FILE, digits_edit_multi_rows, write_digits_edit_set
from flowrl.data.items import PromptItem, item_from_record, item_record, load_edit_set, row_sources
from flowrl.data.prompts import SETS_DIR
from flowrl.registry import SAMPLERS
from flowrl.rewards.digits_edit import EditSpec, combine_target, parse_edit

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


class Recording:
    """A reward that records every call's texts and per-row sources (as tuples) and scores the mean pixel."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, sources=None, **meta):
        self.calls.append((list(prompts), [row_sources(s) for s in sources] if sources is not None else None))
        return images.float().flatten(1).mean(1)

    def check(self, items):
        """Every call had each row's sources, all of them, in the row's order (rows keyed by their
        instruction and source pixels: the sample repeats instructions over different sources)."""
        assert self.calls
        for prompts, sources in self.calls:
            assert sources is not None and len(sources) == len(prompts)
            for p, s in zip(prompts, sources):
                assert isinstance(p, str)
                match = [it for it in items if it.prompt == p and len(it.images) == len(s)
                         and all(torch.equal(a, b) for a, b in zip(it.images, s))]
                assert match, (p, [tuple(x.shape) for x in s])  # exactly some row's sources, in its order
        return sum(len(p) for p, _ in self.calls)


@pytest.fixture(scope="module")
def multi():
    return load_prompts("digits-edit-multi-sample")


def test_items_with_several_sources(tmp_path, multi):
    a, b = multi[0].images  # the first row: a 2 and a 3
    two = PromptItem("write the sum of the two digits", [a, b])
    assert two.num_sources == 2 and isinstance(two.image, tuple) and len(two.image) == 2
    assert torch.equal(two.image[0], a) and torch.equal(two.image[1], b)
    assert two.key != PromptItem(two.prompt, [b, a]).key  # the order is part of the identity
    assert PromptItem("x", [a]).key == PromptItem("x", a).key  # a list of one is that one source
    assert PromptItem("x", [a]).image is not None and torch.equal(PromptItem("x", [a]).image, a)
    assert row_sources(None) == () and row_sources(a)[0] is a and all(x is y for x, y in zip(row_sources([a, b]), (a, b)))
    with pytest.raises(ValueError, match="4 source images; a prompt takes 1 to 3"):
        PromptItem("x", [a, a, a, a])
    with pytest.raises(TypeError, match=r"PromptItem.source\[1\]"):
        PromptItem("x", [a, 3])
    # the shipped rows: paths in order, their records round-trip, pickling drops the decoded images
    row = multi[3]
    assert row.num_sources == 3 and [p.name for p in row.sources] == ["digit_1.png", "digit_2.png", "digit_4.png"]
    rec = item_record(row)
    assert isinstance(rec["image"], list) and len(rec["image"]) == 3 and json.loads(json.dumps(rec)) == rec
    assert item_from_record(rec) == row and item_from_record(item_record(multi[-1])) == multi[-1]
    state = pickle.loads(pickle.dumps(row))
    assert "images" not in state.__dict__ and state == row
    # texts and sources, split once
    texts, sources = prompt_parts([row, "a cat"])
    assert texts == [row.prompt, "a cat"] and len(sources[0]) == 3 and sources[1] == ()
    _, meta = reward_inputs([row, multi[-1]], {})
    assert isinstance(meta["sources"][0], tuple) and meta["sources"][1].shape == (3, 16, 16)  # one source: the tensor


def test_edit_set_rows_with_a_list_of_images(tmp_path):
    import numpy as np
    from PIL import Image

    (tmp_path / "img").mkdir()
    for name in ("a", "b"):
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "img" / f"{name}.png")

    def edit_set(rows):
        path = tmp_path / "edits.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    items = load_edit_set(edit_set([{"prompt": "put a next to b", "image": ["img/a.png", "img/b.png"]},
                                    {"prompt": "one", "image": ["img/b.png"]}]))
    assert [p.name for p in items[0].sources] == ["a.png", "b.png"] and items[1].num_sources == 1
    for rows, message in [
        ([{"prompt": "x", "image": []}], "lists 0 images; a row takes 1 to 3"),
        ([{"prompt": "x", "image": ["img/a.png"] * 4}], "lists 4 images"),
        ([{"prompt": "x", "image": ["img/a.png", 7]}], "a path string or a list of 1 to 3 path strings"),
        ([{"prompt": "x", "image": ["img/a.png", "img/gone.png"]}], r"edits.jsonl:1: source image .*gone.png not found"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            load_edit_set(edit_set(rows))


def test_shipped_multi_source_sample(tmp_path, multi):
    write_digits_edit_set(tmp_path)
    assert (tmp_path / MULTI_SAMPLE_FILE).read_text() == (SETS_DIR / MULTI_SAMPLE_FILE).read_text()
    rows = digits_edit_multi_rows()
    assert len(multi) == len(rows) == 13 and {it.num_sources for it in multi} == {1, 2, 3}
    for it, row in zip(multi, rows):
        assert it.meta["source_digits"] == row["source_digits"] and it.meta["target_digit"] == row["target_digit"]


def test_combine_instructions_need_every_source_in_order(multi):
    from flowrl.rewards import build

    assert parse_edit("write the sum of the two digits") == EditSpec("sum", None)
    assert parse_edit("subtract the digit in picture 2 from the digit in picture 1") == EditSpec("difference", None)
    assert parse_edit("show the digit from picture 3") == EditSpec("pick", None, 3)
    assert parse_edit("turn this 3 into an 8") == EditSpec("change", 8)  # the one-source forms are unchanged
    assert combine_target(EditSpec("sum", None), [4, 5, 3]) == 2 and combine_target(EditSpec("sum", None), [4]) is None
    assert combine_target(EditSpec("difference", None), [2, 9]) == 3
    assert combine_target(EditSpec("pick", None, 3), [1, 2]) is None

    reward = build("digits_edit")
    srcs = {d: it.images[k] for it in multi for k, d in enumerate(it.meta["source_digits"])}
    assert reward.probs(torch.stack([srcs[d] for d in sorted(srcs)])).argmax(-1).tolist() == sorted(srcs)
    texts, meta = reward_inputs(multi, {})
    results = torch.stack([srcs.get(it.meta["target_digit"], srcs[9]) for it in multi])  # the target drawn
    good = reward(results, texts, **meta)
    probs = reward.probs(results)
    for i, it in enumerate(multi):
        assert good[i] == probs[i, it.meta["target_digit"]], it.prompt
    assert (good > 0.9).all()
    swapped = [tuple(reversed(s)) if isinstance(s, tuple) else s for s in meta["sources"]]
    bad = reward(results, texts, sources=swapped)
    for i, it in enumerate(multi):
        kind = parse_edit(it.prompt).kind
        if kind in ("difference", "pick") and it.num_sources > 1:
            assert bad[i] < 0.01, it.prompt  # the sources out of order ask for another digit
        else:
            assert bad[i] == good[i], it.prompt  # a sum (and a one-source row) does not depend on the order
    first_only = [s[0] if isinstance(s, tuple) else s for s in meta["sources"]]
    dropped = reward(results, texts, sources=first_only)
    for i, it in enumerate(multi):  # a combine row without the sources it needs is not applicable
        spec = parse_edit(it.prompt)
        needs_more = spec.kind in ("sum", "difference") or (spec.kind == "pick" and spec.picture > 1)
        assert bool(dropped[i].isnan()) == needs_more, it.prompt


@pytest.mark.parametrize("sampler, options", [
    ("group", {"group_size": 2, "num_steps": 2}),
    ("branch", {"num_steps": 3, "split_steps": [0, 1], "window": 2}),
    ("tempflow", {"num_steps": 3, "branch_steps": [0, 1], "branches": 2, "seeds_per_prompt": 1}),
    ("sol", {"pool_size": 4, "preview_steps": 2, "keep": 2, "regen_options": {"num_steps": 2},
             "explore_backend": "int8-dynamic"}),
    ("ode", {"group_size": 2, "num_steps": 2}),
])
def test_every_sampler_hands_the_rewards_every_source_in_order(tiny_digits_policy, multi, sampler, options):
    items = [multi[0], multi[3], multi[5], multi[-1]]  # two, three, two (order matters) and one source
    reward = Recording()
    r = SAMPLERS.get(sampler)(**options)(tiny_digits_policy, items, reward, seed=1)
    assert r.prompts == items
    assert reward.check(items) >= len(items)


def test_offline_dataset_stores_and_rescores_every_source(tiny_digits_policy, multi, tmp_path):
    from flowrl.data.offline import GenerationSettings, add_reward_column, generate_dataset
    from flowrl.data.offline_store import OfflineDataset
    from flowrl.rollout.ode import ode_sample
    from flowrl.scoring import score_images

    items = [multi[3], multi[5], multi[-1]]
    settings = GenerationSettings(k=2, groups_per_prompt=1, num_steps=2, groups_per_shard=2)
    rec = Recording()
    generate_dataset(tmp_path / "ds", tiny_digits_policy, items, {"rec": rec}, settings, sample=ode_sample,
                     score=score_images, progress=False)
    assert rec.check(items) == 6
    ds = OfflineDataset(tmp_path / "ds")
    assert ds.prompts == items and [it.num_sources for it in ds.prompts] == [3, 2, 1]
    again = Recording()
    add_reward_column(tmp_path / "ds", "again", again, tiny_digits_policy.decode, progress=False, score=score_images)
    assert again.check(items) == 6


def test_vlm_judge_sends_every_source_then_the_result(stub, monkeypatch):
    import base64
    import io

    import numpy as np
    from PIL import Image

    from flowrl import rewards

    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    judge = rewards.build("vlm_judge", url=f"http://127.0.0.1:{stub.server_port}/v1", model="stub", concurrency=1)
    grey = lambda v: torch.full((3, 8, 8), v)  # noqa: E731
    sources = [(grey(0.1), grey(0.2), grey(0.4)), grey(0.9)]
    s = judge(torch.stack([grey(0.3), grey(0.6)]), ["combine them", "make it darker"], sources=sources)
    torch.testing.assert_close(s, torch.tensor([0.3, 0.6]), atol=0.01, rtol=0)  # the result (last image) is judged
    shown = {}
    for r in stub.requests:
        parts = r["body"]["messages"][-1]["content"]
        text = next(p["text"] for p in parts if p["type"] == "text")
        shown[text] = [float(np.asarray(Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",")[1])))
                                        .convert("L")).mean() / 255) for p in parts if p["type"] == "image_url"]
    multi_text = next(t for t in shown if "Instruction: combine them" in t)
    assert "You are given 3 source images" in multi_text
    assert shown[multi_text] == pytest.approx([0.1, 0.2, 0.4, 0.3], abs=0.01)  # every source in order, then the result
    one = next(t for t in shown if "Instruction: make it darker" in t)
    assert "the first is the source image" in one and shown[one] == pytest.approx([0.9, 0.6], abs=0.01)


def test_remote_reward_and_wire_carry_every_source(multi):
    """Requests split mid-set keep each row's sources with it (tests/test_conditions.py checks whole sets);
    the payload sends all sources row after row with their counts, none for one source per row."""
    from helpers_reward_server import remote_kwargs, served

    from flowrl import rewards
    from flowrl.rewards._wire import ImageRows, decode_request, encode_request

    local = rewards.build("digits_edit")
    results = torch.rand(len(multi), 3, 16, 16, generator=torch.Generator().manual_seed(0))
    texts, meta = reward_inputs(multi, {})
    single = [it for it in multi if it.num_sources == 1]
    t1, _ = reward_inputs(single, {})
    with served("digits_edit") as url:
        split = rewards.build("remote", **remote_kwargs(url, encoding="float32", batch_size=5))  # requests of 5, 5, 3
        per_request = torch.cat([local(results[s], texts[s], sources=meta["sources"][s])
                                 for s in (slice(0, 5), slice(5, 10), slice(10, 13))])
        assert torch.equal(split(results, texts, **meta), per_request)
    rows = ImageRows(torch.stack([im for it in multi[:3] for im in it.images]), (2, 2, 2))
    body = encode_request(results[:3], texts[:3], {"sources": rows}, "png")
    images, prompts, got = decode_request(body)
    assert prompts == texts[:3] and all(isinstance(r, tuple) and len(r) == 2 for r in got["sources"])
    assert all(torch.equal(a, b) for it, r in zip(multi[:3], got["sources"]) for a, b in zip(it.images, r))
    plain = encode_request(results[:2], t1, {"sources": torch.stack([it.image for it in single])})
    assert b"image_counts" not in plain
