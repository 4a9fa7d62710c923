"""DiffusionNFT through the one trainer: Sol-RL's ODE regeneration, trained on samples alone."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.errors import ConfigError
from flowrl.trainers.online import train


def _recipe(tmp_path, regen="ode"):
    recipe = yaml.safe_load(open("recipes/digits_sol.yaml"))
    recipe["sampler"].update({"explore_backend": "none", "pool_size": 6, "keep": 4, "preview_steps": 2,
                              "regen": regen, "regen_options": {"num_steps": 3}})
    path = tmp_path / "nft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _cfg(path, model_dir, **extra):
    ov = [o for o in tiny_train_overrides(model_dir, **{"train.lr": 1e-2, "train.batch_size": 8, "train.loss": "nft",
                                                        "train.loss_options": "{}",
                                                        "train.minibatch_size": 4, **extra})
          if not o.startswith("sampler.")]
    return load_config(path, ov)


def _weights(run):
    ck = list_checkpoints(run / "checkpoints")[-1]
    return load_file(str(ck / "trainable.safetensors")), load_file(str(ck / "extra_old_policy.safetensors"))


def test_nft_trains_on_ode_samples_and_resumes_exactly(tiny_digits_dir, tmp_path):
    path = _recipe(tmp_path)
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(path, tiny_digits_dir, **{"train.iterations": 3}), full)
    recs = [json.loads(l) for l in (full / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert len(recs) == 3 and all(r["transitions_trained"] > 0 and "nft/old_decay" in r for r in recs)
    w, old = _weights(full)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())
    assert any(not torch.equal(w[k], old[k]) for k in w)  # the old policy lags behind theta
    train(_cfg(path, tiny_digits_dir, **{"train.iterations": 1}), part)
    train(_cfg(path, tiny_digits_dir, **{"train.iterations": 3}), part, resume=True)
    w2, old2 = _weights(part)
    assert all(torch.equal(w[k], w2[k]) and torch.equal(old[k], old2[k]) for k in w)


def test_grpo_on_an_ode_sampler_is_a_clear_error(tiny_digits_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.loss=nft"):
        train(_cfg(_recipe(tmp_path), tiny_digits_dir, **{"train.loss": "grpo", "train.iterations": 1}), tmp_path / "r")
