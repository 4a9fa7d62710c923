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


def test_pretraining_saves_the_weights_moving_average(tmp_path):
    """``ema``: the saved base is the average of the weights along the steps, so (3 warm-up steps, decays 0.1, 0.18,
    0.25) it sits between the initial and the last weights; ``ema: 0`` saves the last weights."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.pretrain_config import ShapesPretrainConfig

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    for ema in (0.0, 0.9):
        ShapesPolicy.pretrain(tmp_path / f"ema{ema}", ShapesPretrainConfig(steps=3, batch_size=2, ema=ema), progress=False)
    torch.manual_seed(0)  # the pretraining's own initialisation (config.seed 0)
    init = flat(SD3Transformer2DModel(**ShapesPolicy.transformer_config()))
    last, avg = (flat(ShapesPolicy.from_pretrained(tmp_path / f"ema{e}").transformer) for e in (0.0, 0.9))
    moved = (last - init).abs() > 1e-6
    assert moved.sum() > 1000
    share = ((avg - init) / (last - init))[moved]  # 0: the initial weight, 1: the last one
    assert 0.5 < share.median() < 0.97 and (avg - init).norm() < (last - init).norm()


def test_pretraining_continues_from_a_saved_or_cached_base(tmp_path, monkeypatch):
    """``init``: the pretraining starts from a saved base's weights (not random ones) and moves them; a cached
    base's folder name is pretrained into the cache first when missing (with its own settings); anything else
    is a one-line error naming what it takes."""
    from flowrl.errors import ConfigError
    from flowrl.pipelines import pixel_flow
    from flowrl.pipelines.pretrain_config import ShapesPretrainConfig

    def flat(path):
        return torch.cat([p.detach().flatten() for p in ShapesPolicy.from_pretrained(path).transformer.parameters()])

    tiny = dict(batch_size=2, warmup=0)
    monkeypatch.setattr(pixel_flow, "default_cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(ShapesPolicy, "earlier_bases", {"shapes-base-v0": ShapesPretrainConfig(steps=2, seed=5, **tiny)})
    ShapesPolicy.pretrain(tmp_path / "next", ShapesPretrainConfig(steps=1, init="shapes-base-v0", **tiny),
                          progress=False)
    start = flat(tmp_path / "cache" / "shapes-base-v0")  # pretrained first, into the cache
    ShapesPolicy.pretrain(tmp_path / "scratch", ShapesPretrainConfig(steps=1, **tiny), progress=False)
    moved, fresh = (flat(tmp_path / "next") - start).abs(), (flat(tmp_path / "scratch") - start).abs()
    assert 0 < moved.max() < 1e-2 < fresh.max()  # one small step from the cached base, far from a random start
    with pytest.raises(ConfigError, match="neither a saved shapes base.*shapes-base-v0"):
        ShapesPolicy.pretrain(tmp_path / "bad", ShapesPretrainConfig(steps=1, init=str(tmp_path / "nope"), **tiny),
                              progress=False)


def test_grpo_on_the_shapes_recipe_trains_on_the_geneval_rules_end_to_end(pretrained_shapes_base, tmp_path):
    """recipes/shapes.yaml, shortened (4 prompts x 8 samples, 2 iterations), on the session's short-pretrained
    base: the shapes detector's GenEval partial score varies within groups (an advantage to learn from), no
    step is skipped, and the held-out evaluation scores before and after. (That GRPO RAISES the held-out
    score is not asserted: at this size the rise is within the evaluation's noise, docs/models.md.)"""
    import math

    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import train_records

    cfg = load_config("recipes/shapes.yaml", [
        "train.iterations=2", "train.batch_size=32", "train.minibatch_size=64", "train.grad_accum=1",
        "data.eval_seeds_per_prompt=2", "logging.trackers=[]", "logging.progress=false", "logging.eval_every=2",
        "logging.image_every=100", "reward.heldout={}", "train.checkpoint_every=100"])
    summary = train(cfg, tmp_path / "run")
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    assert all(math.isfinite(v) and -1 <= v <= 1 for v in (before, after)), (before, after)
    records = train_records(tmp_path / "run")
    assert len(records) == 2 and all(r["zero_var_fraction"] < 1 and r["reward_std"] > 0 for r in records)
    assert summary["skipped_steps"] == 0
