"""The shapes world's model (flowrl.pipelines.shapes): its text encoder, save/load, reference renders, and
``flowrl pretrain-shapes`` (cache + report); end to end, GRPO on recipes/shapes.yaml raises the held-out
GenEval partial score of the (short-pretrained) shapes base."""
import functools
import json

import pytest
import torch

from flowrl.pipelines import build_policy
from flowrl.pipelines.shapes import UNKNOWN, VOCAB, ShapesPolicy, ShapesTextEncoder, tokenize

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture
def tiny_shapes_dir(tmp_path):
    return ShapesPolicy.make_tiny("shapes", tmp_path / "m")


def test_tokenize_knows_the_world_and_maps_other_words_to_one_id():
    ids = tokenize(["a photo of a red circle left of a square", "a purple hexagon", ""], max_len=12)
    assert ids.shape == (3, 12) and (ids[0, :10] > UNKNOWN).all() and (ids[0, 10:] == 0).all()
    assert ids[1, :3].tolist() == [VOCAB.index("a") + 2, UNKNOWN, UNKNOWN] and ids[2].sum() == 0


def test_text_encoder_tells_apart_prompts_one_word_or_the_order_apart_and_ignores_batch_mates():
    torch.manual_seed(0)
    te = ShapesTextEncoder().eval()
    prompts = ["a photo of a red circle and a blue square", "a photo of a red circle and a green square",
               "a photo of a circle left of a square", "a photo of a square left of a circle", ""]
    with torch.no_grad():
        out = te(prompts)
        alone = te(prompts[:1])
    ehs, pooled = out["encoder_hidden_states"], out["pooled_projections"]  # [5, 12, 64], [5, 64]
    assert not torch.allclose(ehs[0], ehs[1]) and not torch.allclose(pooled[0], pooled[1])  # one colour word
    assert not torch.allclose(pooled[2], pooled[3])  # the same words in another order (attention + positions)
    assert torch.equal(pooled[4], te.null_pooled) and ehs[4].abs().sum() == 0  # "" -> the learned null
    assert torch.equal(alone["pooled_projections"][0], pooled[0])  # bit-identical alone or in a batch


def test_save_load_round_trip_and_reference_renders(tiny_shapes_dir):
    policy = ShapesPolicy.from_pretrained(tiny_shapes_dir)
    policy.save_pretrained(tiny_shapes_dir.parent / "again")
    loaded = build_policy("shapes", str(tiny_shapes_dir.parent / "again"), guidance_scale=2.0)
    x = policy.initial_noise([1, 2])  # [2, 3, 32, 32]
    prompts = ["a photo of two circles", "a photo of a yellow diamond"]
    with torch.no_grad():
        v = policy.velocity(x, torch.tensor([0.5, 0.5]), policy.encode_prompts(prompts))
        loaded.guidance_scale = 1.0
        assert torch.equal(v, loaded.velocity(x, torch.tensor([0.5, 0.5]), loaded.encode_prompts(prompts)))
    assert x.shape == (2, 3, 32, 32) and v.shape == x.shape
    ref = policy.reference_images(prompts, 3)
    assert ref.shape == (6, 3, 32, 32) and ref.min() >= 0 and ref.max() <= 1
    assert torch.allclose(policy.encode(ref), ref * 2 - 1)  # encode inverts decode on RGB
    assert policy.reference_images(["a handwritten digit 3"], 2) is None
    with pytest.raises(FileNotFoundError, match="flowrl pretrain-shapes"):
        build_policy("shapes", str(tiny_shapes_dir.parent / "nope"))


def test_pretrain_shapes_writes_the_cache_and_its_report(tmp_path, monkeypatch, capsys):
    from flowrl import shapes_report
    from flowrl.cli import main

    monkeypatch.setattr(shapes_report, "sample_grid_report",
                        functools.partial(shapes_report.sample_grid_report, per_tag=1, num_steps=2))
    out = tmp_path / "base"
    assert main(["pretrain-shapes", "--out", str(out), "--steps", "2", "--batch-size", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (out / "transformer").is_dir() and (out / "text_encoder").is_dir() and (out / "samples.png").is_file()
    assert result["pretrain"]["steps_done"] == 2 and result["samples"] == 6  # one held-out prompt per tag
    for g in ("guidance_1", "guidance_3"):
        scores = next(iter(result[g].values()))
        assert set(scores) == {"single_object", "two_object", "counting", "colors", "position", "color_attr", "mean"}
    assert main(["pretrain-shapes", "--out", str(out)]) == 0  # cached: neither retrained nor re-measured
    assert "already at" in capsys.readouterr().err
