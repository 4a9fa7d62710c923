"""Text-embedding cache: cached conditioning equals the encoder's (bit for bit on digits and for the
batch it was encoded in; SD3's encoders vary by ~1e-7 with batch composition), directory round
trip and extension, fingerprint check, dropped encoders, and a training run with the cache +
dropped encoders ending on the same weights as one without."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.data.embeddings import INDEX, CachedTextPolicy, TextCacheError, TextEmbeddingCache, model_fingerprint
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.errors import ConfigError
from flowrl.trainers.online import train
from flowrl.types import FlowPolicy, swapped_transformer

PROMPTS = [f"a handwritten digit {d}" for d in range(10)]


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_memory_cache_equals_encoder(tiny_digits_policy, guidance):
    pol = tiny_digits_policy
    pol.guidance_scale = guidance
    cache = TextEmbeddingCache.build(pol, PROMPTS, batch_size=3)
    batch = [PROMPTS[7], PROMPTS[2], PROMPTS[7], PROMPTS[0]]  # repeats and any order
    _assert_same(cache.encode(batch), pol.encode_prompts(batch))
    if guidance > 1.0:  # the negative prompt's rows are stored once, not per prompt
        assert set(cache.shared) == {"neg_encoder_hidden_states", "neg_pooled_projections"}
        assert all(v.shape[0] == 1 for v in cache.shared.values())
    else:
        assert not cache.shared


def test_directory_round_trip_extend_and_fingerprint(tiny_digits_policy, tmp_path):
    pol = tiny_digits_policy
    pol.guidance_scale = 2.0
    d = tmp_path / "cache"
    TextEmbeddingCache.open_or_build(pol, PROMPTS[:5], str(d), "fp-a")
    assert len(json.loads((d / INDEX).read_text())["shards"]) == 1
    c2 = TextEmbeddingCache.open_or_build(pol, PROMPTS, str(d), "fp-a")  # adds 5 prompts as a new shard
    assert len(c2) == 10 and len(json.loads((d / INDEX).read_text())["shards"]) == 2
    loaded = TextEmbeddingCache.load(str(d), "fp-a")
    _assert_same(loaded.encode(PROMPTS[::-1]), pol.encode_prompts(PROMPTS[::-1]))
    with pytest.raises(TextCacheError, match="different model setting.*delete the directory"):
        TextEmbeddingCache.load(str(d), "fp-b")
    (d / "emb-00001.safetensors").unlink()
    with pytest.raises(TextCacheError, match="missing; delete"):
        TextEmbeddingCache.load(str(d), "fp-a")


def test_fingerprint_follows_the_settings_that_change_embeddings():
    base = {"pipeline": "sd3", "path": "m", "guidance_scale": 4.5, "options": {"max_sequence_length": 256}}
    assert model_fingerprint(base) == model_fingerprint({**base, "device": "cuda:1"})
    assert model_fingerprint(base) != model_fingerprint({**base, "options": {"max_sequence_length": 128}})
    assert model_fingerprint(base) != model_fingerprint({**base, "guidance_scale": 1.0})


def test_wrap_drops_encoders_and_names_unknown_prompts(tiny_digits_policy):
    base = tiny_digits_policy
    want = base.encode_prompts(PROMPTS[:3])
    cache = TextEmbeddingCache.build(base, PROMPTS[:3])
    pol = cache.wrap(base, drop_encoders=True)
    assert isinstance(pol, CachedTextPolicy) and pol.wrapped is base and pol.text_embedding_cache is cache
    assert "encode_prompts" not in vars(base)  # the policy object is not patched
    assert base.text_encoder is None and pol.text_encoder is None and pol.freed_parameters > 0
    _assert_same(pol.encode_prompts(PROMPTS[:3]), want)
    with pytest.raises(TextCacheError, match="'a handwritten digit 9' is not in the text-embedding cache"):
        pol.encode_prompts([PROMPTS[9]])


def test_wrap_without_dropping_encodes_new_prompts(tiny_digits_policy):
    base = tiny_digits_policy
    want = base.encode_prompts([PROMPTS[9]])
    cache = TextEmbeddingCache.build(base, PROMPTS[:3])
    pol = cache.wrap(base)
    got = pol.encode_prompts([PROMPTS[9], PROMPTS[0]])
    assert torch.equal(got["encoder_hidden_states"][:1], want["encoder_hidden_states"])
    assert PROMPTS[9] in cache and len(cache) == 4


def test_legacy_attach_patches_in_place(tiny_digits_policy):
    pol = tiny_digits_policy
    want = pol.encode_prompts(PROMPTS[:3] + [PROMPTS[9]])
    cache = TextEmbeddingCache.build(pol, PROMPTS[:3])
    assert cache.attach(pol) == 0 and pol.text_embedding_cache is cache
    _assert_same(pol.encode_prompts(PROMPTS[:3]), {k: v[:3] for k, v in want.items()})
    got = pol.encode_prompts([PROMPTS[9]])  # encoded by the original encoder, not the patched one
    assert torch.equal(got["encoder_hidden_states"], want["encoder_hidden_states"][3:])


def test_wrapper_forwards_transformer_swaps_and_velocity(tiny_digits_policy):
    base = tiny_digits_policy
    pol = TextEmbeddingCache.build(base, PROMPTS[:2]).wrap(base)
    assert isinstance(pol, FlowPolicy)
    x, sigma = base.initial_noise([1, 2]), torch.full((2,), 0.5)
    cond = pol.encode_prompts(PROMPTS[:2])
    v = pol.velocity(x, sigma, cond)
    assert torch.equal(v, base.velocity(x, sigma, cond))
    other = copy.deepcopy(base.transformer)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1)
    trained = base.transformer
    with swapped_transformer(pol, other):  # set on the wrapper -> the wrapped policy runs `other`
        assert base.transformer is other and pol.transformer is other
        assert not torch.equal(pol.velocity(x, sigma, cond), v)
    assert base.transformer is trained and torch.equal(pol.velocity(x, sigma, cond), v)
    pol.guidance_scale = 2.5
    assert base.guidance_scale == 2.5 and "guidance_scale" not in vars(pol)
    assert CachedTextPolicy(pol, pol.text_embedding_cache).wrapped is base  # one cache layer, not two


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_tiny_sd3_flux_cache_with_cfg(tmp_path, kind):
    from flowrl.pipelines import build_policy
    from flowrl.pipelines.tiny import make_tiny

    path = make_tiny(kind, tmp_path / kind, image_size=32)
    opts = {"sd3": {"guidance_scale": 3.0}, "flux": {"guidance_scale": 3.5, "true_cfg_scale": 2.0}}[kind]
    pol = build_policy(kind, str(path), device="cpu", max_sequence_length=8, **opts)
    prompts = ["a photo of a cat", "a red apple on a table", "a blue car"]
    want, want_rev = pol.encode_prompts(prompts), pol.encode_prompts(prompts[::-1])
    cache = TextEmbeddingCache.build(pol, prompts)
    assert cache.shared and all(k.startswith("negative_") for k in cache.shared)  # CFG's negative prompt: once
    pol = cache.wrap(pol, drop_encoders=True)
    assert pol.freed_parameters > 0 and pol.pipe.text_encoder is None and pol.pipe.text_encoder_2 is None
    _assert_same(pol.encode_prompts(prompts), want)  # the batch it was encoded in: bit for bit
    got = pol.encode_prompts(prompts[::-1])  # another batch: the encoders themselves differ by ~1e-7 (SD3's CLIP)
    for k in want_rev:
        torch.testing.assert_close(got[k], want_rev[k], rtol=0, atol=1e-5)


def test_drop_without_cache_is_a_config_error(tiny_digits_dir):
    with pytest.raises(ConfigError, match="drop_text_encoders=true needs model.text_embedding_cache"):
        load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{"model.drop_text_encoders": "true"}))


def test_training_with_cache_and_dropped_encoders_matches(tiny_digits_dir, tmp_path):
    """Same seeds, same weights: the cache changes memory, not the trajectory."""
    runs = {}
    for name, extra in {"plain": {}, "cached": {"model.text_embedding_cache": str(tmp_path / "emb"),
                                                "model.drop_text_encoders": "true"}}.items():
        cfg = load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 2, **extra}))
        train(cfg, tmp_path / name)
        runs[name] = load_file(str(list_checkpoints(tmp_path / name / "checkpoints")[-1] / "trainable.safetensors"))
    _assert_same(runs["plain"], runs["cached"])
    assert len(json.loads((tmp_path / "emb" / INDEX).read_text())["shards"][0]["prompts"]) == 10
