"""The flat ODE sampler (DiffusionNFT's own set-up) and the config check that GRPO is not given
a sampler without stochastic transitions."""
import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.rollout.ode import ODEGroupSampler, ode_sample
from flowrl.checkpoints.common import list_checkpoints
from flowrl.errors import ConfigError
from flowrl.trainers.online import train


def test_ode_group_sampler_matches_ode_sample(tiny_digits_policy):
    prompts = ["a handwritten digit 1", "a handwritten digit 8"]
    ro = ODEGroupSampler(group_size=3, num_steps=4)(tiny_digits_policy, prompts, seed=5)
    x0, images = ode_sample(tiny_digits_policy, [p for p in prompts for _ in range(3)], ro.seeds.tolist(), 4)
    assert torch.equal(ro.x0, x0) and torch.equal(ro.images, images)
    assert len(ro.transitions) == 0 and ro.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.stats["model_evals"] == 6 * 4 and len(set(ro.seeds.tolist())) == 6


@pytest.mark.parametrize("sampler", [
    ["sampler.name=ode", "sampler.group_size=4"],
    ["sampler.name=sol", "sampler.pool_size=8", "sampler.keep=4", "sampler.regen=ode", "sampler.explore_backend=none"],
])
def test_grpo_needs_stochastic_transitions(tiny_digits_dir, sampler):
    import yaml

    from flowrl.trainers.config import Config
    from flowrl.trainers.config_text import apply_overrides

    d = yaml.safe_load(open("recipes/digits.yaml"))
    d["sampler"] = {}
    with pytest.raises(ConfigError, match="stores no stochastic transitions.*train.loss=nft"):
        Config.from_dict(apply_overrides(d, sampler + ["train.batch_size=16"]))
    cfg = Config.from_dict(apply_overrides(d, sampler + ["train.batch_size=16", "train.loss=nft", "train.loss_options={}"]))
    assert cfg.prompts_per_iteration == 4


def test_flat_nft_trains(tiny_digits_dir, tmp_path):
    import yaml

    from flowrl.trainers.config import Config
    from flowrl.trainers.config_text import apply_overrides

    d = yaml.safe_load(open("recipes/digits_sol_nft.yaml"))
    d["sampler"] = {"name": "ode", "group_size": 4, "num_steps": 4}
    cfg = Config.from_dict(apply_overrides(d, [o for o in tiny_train_overrides(tiny_digits_dir, **{"train.iterations": 2})
                                               if not o.startswith("sampler.")]))
    assert cfg.sampler.name == "ode" and cfg.train.loss == "nft"
    assert train(cfg, tmp_path / "run")["iterations_done"] == 2
    w = load_file(str(list_checkpoints(tmp_path / "run" / "checkpoints")[-1] / "trainable.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())
