"""Offline group datasets (safetensors shards + JSON index): layout, determinism, atomic writes,
resume after an interruption, growth, and re-scoring without regeneration."""

import pytest
import torch
from safetensors.torch import load_file

from flowrl.data.offline import GenerationSettings, add_reward_column, generate_dataset, group_seeds
from flowrl.data.offline_store import DatasetError, OfflineDataset, read_index
from flowrl.rollout.ode import ode_sample
from flowrl.scoring import score_images

PROMPTS = [f"a handwritten digit {d}" for d in range(3)]


class MeanReward:
    """Cheap deterministic reward: mean brightness."""

    name = "mean"

    def __call__(self, images, prompts, **meta):
        return images.float().mean(dim=(1, 2, 3))


class CountingReward(MeanReward):
    def __init__(self):
        self.calls = 0

    def __call__(self, images, prompts, **meta):
        self.calls += 1
        return super().__call__(images, prompts)


def _settings(**kw):
    base = dict(k=3, groups_per_prompt=3, num_steps=2, seed=7, groups_per_shard=2, generation_batch=4)
    base.update(kw)
    return GenerationSettings(**base)


def _gen(out, policy, **kw):
    s = _settings(**{k: v for k, v in kw.items() if k in GenerationSettings.__dataclass_fields__})
    rest = {k: v for k, v in kw.items() if k not in GenerationSettings.__dataclass_fields__}
    return generate_dataset(out, policy, PROMPTS, {"mean": MeanReward()}, s, sample=ode_sample, score=score_images,
                            model={"pipeline": "digits"}, progress=False, **rest)


def _content(path):
    """Everything a dataset holds, except the seconds it took."""
    idx = read_index(path)
    for k in ("generation_seconds", "reward_seconds"):
        idx.pop(k)
    files = {p.name: load_file(str(p)) for p in sorted(path.glob("*.safetensors"))}
    return idx, files


def _assert_same(a, b):
    ia, fa = _content(a)
    ib, fb = _content(b)
    assert ia == ib
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name].keys() == fb[name].keys()
        for k in fa[name]:
            assert torch.equal(fa[name][k], fb[name][k]), (name, k)


@pytest.fixture(scope="module")
def full_dataset(tmp_path_factory):
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    policy = DigitsPolicy(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1}).eval(),
                          DigitTextEncoder().eval())
    out = tmp_path_factory.mktemp("offline") / "full"
    _gen(out, policy)
    return out, policy


def test_layout_and_group_identity(full_dataset):
    path, policy = full_dataset
    ds = OfflineDataset(path)
    assert len(ds) == 9 and ds.k == 3 and ds.latent_shape == (1, 16, 16) and ds.reward_names == ["mean"]
    idx = read_index(path)
    assert [(s["start"], s["count"]) for s in idx["shards"]] == [(0, 2), (2, 2), (4, 2), (6, 2), (8, 1)]
    assert idx["model_evals"] == 9 * 3 * 2 and idx["generation_seconds"] > 0
    b = ds.read([7, 0, 4])
    assert b.x0.shape == (3, 3, 1, 16, 16) and b.x0.dtype == torch.float32
    assert b.group.tolist() == [7, 0, 4]
    assert b.prompts == [PROMPTS[7 % 3], PROMPTS[0], PROMPTS[4 % 3]]  # round-robin over prompts
    assert b.seeds[0].tolist() == group_seeds(7, 7, 3)
    # a group is the deterministic sample of (its prompt, its seeds), whatever its batch-mates were
    x0, images = ode_sample(policy, [b.prompts[0]] * 3, b.seeds[0].tolist(), 2)
    assert torch.allclose(b.x0[0], x0, atol=1e-5)
    assert torch.allclose(b.rewards["mean"][0], images.mean(dim=(1, 2, 3)), atol=1e-5)
    assert not any(p.name.startswith(".") for p in path.iterdir())  # no temporary leftovers
    order = ds.epoch_order(0, 1)
    assert sorted(order.tolist()) == list(range(9)) and torch.equal(order, ds.epoch_order(0, 1))
    assert not torch.equal(order, ds.epoch_order(0, 2))
    with pytest.raises(DatasetError, match="rescore-offline"):
        ds.read([0], rewards=["ocr"])
    with pytest.raises(DatasetError, match="not in the dataset"):
        ds.read([9])


def test_resume_after_interruption_equals_uninterrupted(full_dataset, tmp_path):
    path, policy = full_dataset
    part = tmp_path / "part"

    def crash(number):
        if number == 2:  # shard 2's file is in place, the index does not list it yet
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _gen(part, policy, on_shard=crash)
    assert len(read_index(part)["shards"]) == 2  # only complete, indexed shards count
    assert (part / "shard-000002.safetensors").exists()  # an orphan: rewritten on resume
    (part / ".shard-000003.safetensors.tmp-123").write_bytes(b"half a file")  # a crash mid-write
    assert len(OfflineDataset(part)) == 4
    _gen(part, policy, max_new_shards=1)  # a budget: one more shard, then stop
    assert len(read_index(part)["shards"]) == 3
    _gen(part, policy)
    _assert_same(path, part)
    assert not any(p.name.startswith(".") for p in part.iterdir())


def test_resume_with_other_settings_is_refused(full_dataset, tmp_path):
    path, policy = full_dataset
    part = tmp_path / "part"
    _gen(part, policy, max_new_shards=1)
    with pytest.raises(DatasetError, match="num_steps"):
        _gen(part, policy, num_steps=3)
    with pytest.raises(DatasetError, match="prompts"):
        generate_dataset(part, policy, PROMPTS[:2], {"mean": MeanReward()}, _settings(), sample=ode_sample,
                         score=score_images, model={"pipeline": "digits"}, progress=False)
    with pytest.raises(DatasetError, match="not an offline dataset"):
        other = tmp_path / "other"
        other.mkdir()
        (other / "notes.txt").write_text("x")
        _gen(other, policy)
    with pytest.raises(DatasetError, match="generate-offline"):
        OfflineDataset(tmp_path / "missing")


def test_growing_keeps_existing_shards(full_dataset, tmp_path):
    path, policy = full_dataset
    small = tmp_path / "small"
    _gen(small, policy, groups_per_prompt=1)  # 3 groups: shards (0, 2), (2, 1)
    before = {p.name: p.stat().st_mtime_ns for p in small.glob("*.safetensors")}
    _gen(small, policy, groups_per_prompt=3)
    ds = OfflineDataset(small)
    assert len(ds) == 9 and [s["count"] for s in read_index(small)["shards"]] == [2, 1, 2, 2, 2]
    assert {p.name: p.stat().st_mtime_ns for p in small.glob("*.safetensors") if p.name in before} == before
    full = OfflineDataset(path)
    for g in range(9):  # same groups as the dataset generated at full size in one go
        assert torch.allclose(ds.read([g]).x0, full.read([g]).x0, atol=1e-5)
    with pytest.raises(DatasetError, match="grow but not shrink"):
        _gen(small, policy, groups_per_prompt=2)


def test_rescore_adds_a_column_without_regenerating(full_dataset, tmp_path, monkeypatch):
    import shutil

    import flowrl.data.offline as offline

    path, policy = full_dataset
    ds_dir = tmp_path / "ds"
    shutil.copytree(path, ds_dir)
    x0_files = {p.name: p.read_bytes() for p in ds_dir.glob("shard-??????.safetensors")}
    monkeypatch.setattr(offline, "iter_samples", lambda *a, **k: pytest.fail("rescoring must not regenerate"))
    rew = CountingReward()

    def crash_on_third(*a, **k):  # interrupt the rescore after two shards
        if rew.calls == 2:
            raise KeyboardInterrupt
        return real_save(*a, **k)

    real_save = offline._atomic_save_tensors
    monkeypatch.setattr(offline, "_atomic_save_tensors", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        add_reward_column(ds_dir, "bright", rew, policy.decode, batch_images=100, progress=False, score=score_images)
    assert "bright" not in OfflineDataset(ds_dir).reward_names  # incomplete column: not listed
    monkeypatch.setattr(offline, "_atomic_save_tensors", real_save)
    add_reward_column(ds_dir, "bright", rew, policy.decode, batch_images=100, progress=False, score=score_images)
    assert rew.calls == 2 + 4  # 5 shards, the first one was not redone after the interruption
    ds = OfflineDataset(ds_dir)
    assert ds.reward_names == ["mean", "bright"]
    b = ds.read(list(range(9)))
    assert torch.allclose(b.rewards["bright"], b.rewards["mean"], atol=1e-6)  # same function, same images
    assert {p.name: p.read_bytes() for p in ds_dir.glob("shard-??????.safetensors")} == x0_files  # untouched
    with pytest.raises(DatasetError, match="overwrite"):
        add_reward_column(ds_dir, "bright", rew, policy.decode, progress=False, score=score_images)
    add_reward_column(ds_dir, "bright", rew, policy.decode, overwrite=True, progress=False, score=score_images)
    (ds_dir / "shard-000001.reward-bright.safetensors").unlink()
    with pytest.raises(DatasetError, match="missing"):
        OfflineDataset(ds_dir)


def test_reduced_precision_latents_and_pngs(full_dataset, tmp_path):
    path, policy = full_dataset
    out = tmp_path / "bf16"
    _gen(out, policy, latent_dtype="bfloat16", save_png=True, groups_per_prompt=1)
    ds, full = OfflineDataset(out), OfflineDataset(path)
    f = load_file(str(out / "shard-000000.safetensors"))
    assert f["x0"].dtype == torch.bfloat16 and f["seeds"].dtype == torch.int64
    assert torch.allclose(ds.read([1]).x0, full.read([1]).x0, atol=2e-2)
    assert sorted(p.name for p in (out / "png").iterdir())[:2] == ["g000000_s0.png", "g000000_s1.png"]
    assert len(list((out / "png").iterdir())) == 3 * 3


def test_heun_sampler(full_dataset, tmp_path):
    path, policy = full_dataset
    out = tmp_path / "heun"
    idx = _gen(out, policy, sampler="heun", groups_per_prompt=1)
    assert idx["model_evals"] == 3 * 3 * (2 * 2 - 1)
    assert not torch.allclose(OfflineDataset(out).read([0]).x0, OfflineDataset(path).read([0]).x0)
    with pytest.raises(ValueError, match="euler"):
        GenerationSettings(sampler="sde")


def test_truncated_shard_is_a_clear_error_and_repairable(full_dataset, tmp_path):
    import shutil

    path, policy = full_dataset
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = sorted(copy.glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(DatasetError, match="is damaged.*Delete it and rerun"):
        OfflineDataset(copy).read([0])
    shard.unlink()  # the documented recovery: delete it, rerun generation
    _gen(copy, policy)
    _assert_same(copy, path)


def test_disk_full_while_writing_a_shard_leaves_no_partial_file(full_dataset, tmp_path, monkeypatch):
    import errno

    import flowrl.data.offline as off

    path, policy = full_dataset

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(off, "save_file", full)
    out = tmp_path / "full"
    with pytest.raises(DatasetError, match="No space left.*complete shards are intact"):
        _gen(out, policy)
    assert not any(p.name.startswith(".") or p.suffix == ".safetensors" for p in out.iterdir())
    monkeypatch.undo()
    _gen(out, policy)  # after freeing space, the same command completes the dataset
    _assert_same(out, path)
