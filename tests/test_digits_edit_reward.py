"""The offline editing reward ``digits_edit`` (rewards/digits_edit.py): instruction grammar, scores
equal to the digits classifier's probabilities times the stroke term computed here by hand, NaN
where not applicable, the source through ``sources=`` (also through MultiReward), errors."""
import pytest
import torch
import torch.nn.functional as F

from flowrl.data.digits_edit import SAMPLE_FILE
from flowrl.data.items import item_sources, item_texts, load_edit_set
from flowrl.data.prompts import SETS_DIR
from flowrl.rewards import REGISTRY, build, build_multi
from flowrl.rewards.digits import to_8x8
from flowrl.rewards.digits_edit import DigitsEditReward, EditSpec, parse_edit


@pytest.fixture(scope="module")
def reward():
    return build("digits_edit")


@pytest.fixture(scope="module")
def shipped():
    return load_edit_set(SETS_DIR / SAMPLE_FILE)


def test_instruction_grammar():
    assert parse_edit("turn this 3 into an 8") == EditSpec("change", 8)
    assert parse_edit("Change the digit into a Seven") == EditSpec("change", 7)
    assert parse_edit("turn it into 5") == EditSpec("change", 5)
    assert parse_edit("make the strokes of this 0 thicker") == EditSpec("thicker", 0)
    assert parse_edit("make it bolder") == EditSpec("thicker", None)  # digit read from the source
    assert parse_edit("make the 4 lighter") == EditSpec("thinner", 4)
    assert parse_edit("turn this into a cat") is None and parse_edit("add a hat") is None


def test_scores_are_the_classifier_probabilities_and_the_stroke_term(reward, shipped):
    items = shipped[:]  # 10 changes, 3 thicker, 1 thinner
    sources = item_sources(items)
    thick = [F.max_pool2d(s[None], 3, 1, 1)[0] for s in sources]  # dilated strokes: more ink
    results = torch.stack([sources[0], *thick[1:]])  # [14, 3, 16, 16]: row 0 unchanged
    out = reward(results, item_texts(items), sources=sources)
    assert out.dtype == torch.float32 and out.shape == (14,) and torch.isfinite(out).all()
    assert ((0 <= out) & (out <= 1)).all()

    probs = reward.probs(results)  # [14, 10]
    for i, it in enumerate(items):
        spec = parse_edit(it.prompt)
        p = probs[i, spec.digit]
        if spec.kind == "change":
            assert out[i] == p, it.prompt
        else:
            ratio = to_8x8(results[i:i + 1]).mean() / to_8x8(sources[i][None]).mean()
            term = (ratio - 1) / 0.5 if spec.kind == "thicker" else (1 - ratio) / 0.5
            assert out[i] == pytest.approx(float(p * term.clamp(0, 1)), abs=1e-6), it.prompt
    assert items[13].prompt.endswith("thinner") and out[13] == 0  # thicker strokes on a "thinner" edit score 0
    # a thicker 0 that is still a 0 scores; the unchanged source scores 0 on a stroke edit
    unchanged = reward(sources[0][None], [items[10].prompt], sources=[sources[0]])
    assert unchanged.item() == 0 and out[10] > 0.1


def test_stroke_edit_without_a_named_digit_reads_the_source(reward, shipped):
    src = shipped[4].image  # a 4
    result = F.max_pool2d(src[None], 3, 1, 1)  # [1, 3, 16, 16]
    named = reward(result, ["make the strokes of this 4 thicker"], sources=[src])
    unnamed = reward(result, ["make the strokes thicker"], sources=[src])
    assert int(reward.probs(src[None]).argmax()) == 4 and torch.equal(named, unnamed)


def test_not_applicable_rows_and_errors(reward, shipped):
    src = shipped[0].image
    images = torch.stack([src, src, src])
    out = reward(images, ["turn this 0 into an 8", "add a hat", "turn this 0 into an 8"], sources=[src, src, None])
    assert torch.isfinite(out[0]) and out[1:].isnan().all()  # unknown instruction; no source
    assert reward(images, ["turn this 0 into an 8"] * 3).isnan().all()  # no sources given at all
    stacked = reward(images, ["turn this 0 into an 8"] * 3, sources=images)  # one [B, 3, H, W] tensor
    torch.testing.assert_close(stacked, out[:1].expand(3), rtol=1e-5, atol=1e-12)  # 3-row vs 1-row GEMMs: last bits
    with pytest.raises(ValueError, match="3 images but 2 sources"):
        reward(images, ["x"] * 3, sources=[src, src])
    with pytest.raises(ValueError, match=r"source 1 must be a float \[3, H, W\]"):
        reward(images, ["x"] * 3, sources=[src, src[0], None])
    with pytest.raises(ValueError, match=r"expects images \[B, 3, H, W\]"):
        reward(src, ["x"], sources=[src])
    with pytest.raises(ValueError, match="stroke_change must be > 0"):
        DigitsEditReward(stroke_change=0)


def test_registered_and_sources_pass_through_multireward(reward, shipped):
    assert REGISTRY["digits_edit"] == "flowrl.rewards.digits_edit:DigitsEditReward"
    items = shipped[:3]
    images, prompts, sources = torch.stack(item_sources(items)), item_texts(items), item_sources(items)
    multi = build_multi({"digits_edit": 1.0, "jpeg_compressibility": 0.0})
    comps = multi.components(images, prompts, sources=sources)
    assert torch.equal(comps["digits_edit"], reward(images, prompts, sources=sources))
    assert torch.equal(multi(images, prompts, sources=sources), comps["digits_edit"])
    bigger = F.interpolate(images, size=32, mode="nearest")  # any result size: pooled to the 8 x 8 view
    assert torch.allclose(reward(bigger, prompts, sources=sources), comps["digits_edit"], atol=1e-6)
