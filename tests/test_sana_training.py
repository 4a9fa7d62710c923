"""`flowrl train` on a tiny SANA pipeline (offline: `SanaPolicy.make_tiny`) through the shipped recipe:
the Sol-RL recipe as shipped (shrunk), and a GRPO run with the group sampler (SDE transitions, PPO ratio).

The adapter's own checks (save / load, shapes, export) are in the contract battery
(tests/test_policy_contract.py), which covers SANA like every registered model.
"""
import json

import pytest
import torch

from flowrl.pipelines.tiny import make_tiny
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.trainers.online import train
from helpers import IMAGE, ROOT, lora_weights, tiny_overrides, train_records, two_grpo_iterations

RECIPE = ROOT / "recipes" / "sana_sol_nvfp4.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny_sana(tmp_path_factory):
    return make_tiny("sana", tmp_path_factory.mktemp("tiny-sana") / "sana", image_size=IMAGE)


def test_grpo_trains_on_sana(tiny_sana, tmp_path):
    """Two GRPO iterations (group sampler, SDE steps, CFG on) on the recipe's model section."""
    overrides = ["sampler={name: group, step: sde, noise_level: 0.7}", "train.loss=grpo",
                 "train.loss_options={global_std: true}", "model.guidance_scale=4.5",  # (the recipe's are nft's)
                 f"model.text_embedding_cache={tmp_path / 'emb'}", "train.loss_options.beta_kl=0.04"]
    cfg = load_config(RECIPE, overrides + tiny_overrides(tiny_sana, "group"))
    assert cfg.model.pipeline == "sana" and cfg.sampler.name == "group" and cfg.train.loss == "grpo"
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs, w1, w2 = two_grpo_iterations(run)
    assert w2 and all(".lora_A." in k or ".lora_B." in k for k in w2)
    assert any(".attn2.to_q." in k for k in w2)  # the recipe's cross-attention targets were adapted
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w1.items())
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)


def test_sol_recipe_trains_on_sana(tiny_sana, tmp_path):
    """The shipped Sol-RL recipe (int8 exploration standing in for NVFP4 on CPU), embeddings cached
    on disk and the Gemma-2 text encoder dropped."""
    cfg = load_config(RECIPE, tiny_overrides(tiny_sana, "sol", **{
        "train.iterations": 1, "model.text_embedding_cache": str(tmp_path / "emb"), "model.drop_text_encoders": "true"}))
    assert cfg.sampler.name == "sol" and cfg.train.loss == "nft" and cfg.model.guidance_scale == 1.0
    run = tmp_path / "run"
    assert train(cfg, run)["iterations_done"] == 1
    (rec,) = train_records(run)
    assert torch.isfinite(torch.tensor(rec["loss"])) and rec["sol/explore_model_evals"] == 2 * 4 * 2
    assert len(json.loads((tmp_path / "emb" / "index.json").read_text())["shards"][0]["prompts"]) == 2
    w = lora_weights(list_checkpoints(run / "checkpoints")[-1])
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w.items())
