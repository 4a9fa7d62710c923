"""Flow-DPPO (``train.loss=dppo``) and GARDO on GRPO / DiffusionNFT (``gardo_grpo``, ``gardo_nft``) through
the one trainer: they train on the tiny digits model, GARDO's gate, adaptive reference and refresh
bookkeeping resume exactly, its DINO-family features load offline from a save_pretrained directory, the
digits recipes raise the evaluation reward, and the GPU recipes fit 8 x 80 GiB."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.errors import ConfigError
from flowrl.plan.core import GiB, plan_memory
from flowrl.rewards.features import DinoFeatures, tiny_dino
from flowrl.trainers.config import load_config
from flowrl.trainers.online import OnlineTrainer, train

pytestmark = pytest.mark.usefixtures("one_thread")
ODE = "sampler={name: ode, group_size: 4, num_steps: 4}"
GPU_RECIPES = ["sd3_dppo_pickscore", "flux_dppo_pickscore", "sd3_gardo_grpo_ocr", "flux_gardo_grpo_hps",
               "sd3_gardo_nft_ocr"]


def _records(run) -> list[dict]:
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]


def _checkpoint(run) -> dict:
    """Every tensor of the last checkpoint (trained weights and the update's copies), by file and key."""
    ck = list_checkpoints(run / "checkpoints")[-1]
    return {f"{f.name}/{k}": v for f in sorted(ck.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _cfg(recipe, model_dir, *extra, **options):
    return load_config(recipe, [*tiny_train_overrides(model_dir, **{"train.lr": 1e-2, **options}), *extra])


def test_dppo_trains_with_its_trust_region(tiny_digits_dir, tmp_path):
    run = tmp_path / "dppo"
    train(_cfg("recipes/digits_dppo.yaml", tiny_digits_dir, **{"train.iterations": 2,
                                                                "train.loss_options.kl_threshold": 1e-12}), run)
    recs = _records(run)
    assert len(recs) == 2 and all(r["transitions_trained"] > 0 for r in recs)
    # a threshold no step stays under: every transition is high-KL after the first step, and some moved on
    assert all(0 < r["high_kl_fraction"] <= 1 and r["masked_fraction"] > 0 for r in recs), recs
    wide = tmp_path / "wide"  # a threshold no step reaches: nothing masked, only -A * ratio
    train(_cfg("recipes/digits_dppo.yaml", tiny_digits_dir, **{"train.iterations": 1,
                                                                "train.loss_options.kl_threshold": 1e9}), wide)
    assert _records(wide)[0]["masked_fraction"] == 0 and "clip_fraction" not in _records(wide)[0]
    w = _checkpoint(run)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())


@pytest.mark.parametrize("sampler", [
    "sampler={name: branch, num_steps: 3, split_steps: [0, 1], window: 2}",  # depth-wise advantages of a tree
    "sampler={name: tempflow, num_steps: 3, branch_steps: [0, 1], branches: 2, seeds_per_prompt: 2}",  # weighted
])
def test_dppo_on_the_tree_samplers(sampler, tiny_digits_dir, tmp_path):
    """Any sampler that stores transitions feeds DPPO."""
    run = tmp_path / "run"
    train(_cfg("recipes/digits_dppo.yaml", tiny_digits_dir, sampler, **{"train.iterations": 1,
                                                                         "train.batch_size": 8}), run)
    assert _records(run)[0]["transitions_trained"] > 0 and "masked_fraction" in _records(run)[0]


def test_gardo_grpo_resumes_exactly(tiny_digits_dir, tmp_path):
    """The gate's fraction and history, the refresh bookkeeping and the reference copy are checkpointed:
    one iteration, then --resume to three, equals three uninterrupted (every tensor, every GARDO metric)."""
    # a refresh at iteration 2; a fifth of the samples gated (the default tenth of 16 is one or none, as ties fall)
    opts = {"train.iterations": 3, "train.loss_options.refresh_period": 1, "train.loss_options.gate_fraction": 0.2}
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir, **opts), full)
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir, **{**opts, "train.iterations": 1}), part)
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir, **opts), part, resume=True)
    a, b = _checkpoint(full), _checkpoint(part)
    assert any(k.startswith("extra_gardo_reference") for k in a) and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    recs = _records(full)
    assert [r["gardo/refreshed"] for r in recs] == [0.0, 0.0, 1.0]  # the first copy is the initial weights
    assert all(0 < r["gardo/gated_share"] < 1 and "kl" in r and r["gardo/diversity_weight"] > 0 for r in recs), \
        [(r["gardo/gated_share"], r.get("kl"), r["gardo/diversity_weight"]) for r in recs]
    gardo = lambda r: {k: v for k, v in r.items() if k.startswith("gardo/") or k in ("kl", "loss")}  # noqa: E731
    assert [gardo(r) for r in _records(part)] == [gardo(r) for r in recs]


def test_gardo_nft_with_dino_features_resumes_exactly(tiny_digits_dir, tmp_path):
    """GARDO on DiffusionNFT over ODE samples, diversity measured by a tiny random DINOv2 (save_pretrained,
    loaded offline), the threshold adapted at each refresh: resume equals the uninterrupted run."""
    dino = tiny_dino(tmp_path / "dino")
    extra = [ODE, "train.loss=gardo_nft",
             "train.loss_options={aux_rewards: [jpeg_compressibility], refresh_period: 1, kl_threshold: 0.15, "
             f"features: dino, features_options: {{path: {dino}, size: 32}}}}"]
    opts = {"train.iterations": 3, "train.minibatch_size": 4}
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir, *extra, **opts), full)
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir, *extra, **{**opts, "train.iterations": 1}), part)
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir, *extra, **opts), part, resume=True)
    a, b = _checkpoint(full), _checkpoint(part)
    assert any(k.startswith("extra_gardo_reference") for k in a) and any(k.startswith("extra_old_policy") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    recs = _records(full)
    assert recs[2]["gardo/refreshed"] == 1.0 and recs[2]["gardo/kl_threshold"] == 0.05  # gap 2 < 5: min(t + .01, .05)
    assert [r["gardo/kl_threshold"] for r in _records(part)] == [r["gardo/kl_threshold"] for r in recs]


def test_gardo_grpo_on_sol_regenerating_flat_groups(tiny_digits_dir, tmp_path):
    """Sol-RL's selected seeds regenerated by the group sampler are flat groups: GARDO gates and shapes them."""
    run = tmp_path / "sol"
    train(_cfg("recipes/digits_gardo.yaml", tiny_digits_dir,
               "sampler={name: sol, explore_backend: none, pool_size: 6, keep: 4, preview_steps: 2, regen: group, "
               "regen_options: {num_steps: 3, step: sde, noise_level: 0.7}}",
               **{"train.iterations": 1, "train.batch_size": 8}), run)
    rec = _records(run)[0]
    assert rec["transitions_trained"] > 0 and 0 < rec["gardo/gated_share"] < 1 and "kl" in rec


def test_gardo_grpo_refuses_an_undeclared_tree_sampler(tiny_digits_dir, tmp_path):
    """A sampler object whose transitions branch but that does not declare ``flat_groups``: the update refuses
    its first rollout (the shipped tree samplers are refused when the config loads: test_update_needs)."""
    from flowrl.rollout.branch import BranchSampler

    class Undeclared(BranchSampler):
        flat_groups = True

    cfg = _cfg("recipes/digits_gardo.yaml", tiny_digits_dir, **{"train.iterations": 1, "train.batch_size": 8})
    sampler = Undeclared(num_steps=3, split_steps=[0, 1], window=2)
    with pytest.raises(ConfigError, match="train.loss=gardo_grpo trains on flat groups"):
        OnlineTrainer(cfg, tmp_path / "r", sampler=sampler).train()


def test_dino_features_load_offline(tmp_path):
    path = tiny_dino(tmp_path / "dino")
    assert tiny_dino(path) == path  # already there: kept
    feats = DinoFeatures(str(path), size=32, batch_size=3)
    images = torch.rand(5, 3, 40, 40, generator=torch.Generator().manual_seed(0))  # [B, 3, H, W] in [0, 1]
    f = feats(images)  # [5, 32]
    assert f.shape == (5, 32) and f.dtype == torch.float32 and torch.isfinite(f).all()
    assert torch.equal(f, DinoFeatures(str(path), size=32)(images))  # chunking and a second load change nothing
    assert not torch.allclose(f[0], f[1])


@pytest.mark.parametrize("recipe, loss", [("digits_dppo", "dppo"), ("digits_gardo", "gardo_grpo")])
def test_digits_recipes_raise_the_evaluation_reward(recipe, loss, pretrained_digits_base, tmp_path):
    cfg = load_config(f"recipes/{recipe}.yaml", [
        "train.iterations=12", "logging.trackers=[]", "logging.progress=false", "logging.eval_every=12",
        "reward.heldout={}", "train.checkpoint_every=100"])
    assert cfg.train.loss == loss
    summary = train(cfg, tmp_path / "run")
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    assert after > before + 0.03, (before, after)
    assert summary["skipped_steps"] == 0


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_fit_eight_80_gib_gpus(recipe):
    cfg = load_config(f"recipes/{recipe}.yaml")
    p = plan_memory(cfg, 8, 80 * GiB, recipe)
    assert p.fits, (recipe, p.peak_bytes / GiB)
    names = [i.name for i in p.items]
    if "gardo" in recipe:  # the feature model and the adaptive reference are counted
        assert "update's model: dino" in names and any(n.startswith("gardo reference") for n in names), names
        assert set(cfg.train.update_options.aux_rewards) <= set(cfg.reward.weights)


def test_dinov3_the_papers_family_loads_the_same_way(tmp_path):
    """GARDO's own feature model is a DINOv3 ViT: a tiny random one saved offline loads through AutoModel."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    torch.manual_seed(0)
    DINOv3ViTModel(DINOv3ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   image_size=32, patch_size=8)).save_pretrained(tmp_path / "v3")
    f = DinoFeatures(str(tmp_path / "v3"), size=32)(torch.rand(3, 3, 40, 40))  # [3, 32]
    assert f.shape == (3, 32) and torch.isfinite(f).all()


@pytest.mark.parametrize("cls,ignored", [("GARDOGRPOOptions", {"global_std": True, "advantage_options": {"a": 1}}),
                                         ("GARDONFTOptions", {"global_std": True})])
def test_gardo_refuses_advantage_options_its_diversity_ignores(cls, ignored):
    """Both bases: options of the base's advantage that the diversity-aware advantage ignores are refused with
    diversity on (named), accepted with it off; kl_threshold must be positive."""
    import flowrl.updates.gardo as gardo

    Options = getattr(gardo, cls)
    names = " and ".join(ignored)
    with pytest.raises(ValueError, match=f"loss_options.{names} ha.* no effect with diversity: true"):
        Options(**ignored)
    assert Options(**ignored, diversity=False).diversity is False
    with pytest.raises(ValueError, match="kl_threshold"):
        Options(kl_threshold=0.0)
