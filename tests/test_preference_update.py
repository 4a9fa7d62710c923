"""Online DPO / GDRO (``train.loss: dpo`` / ``gdro``): the update raises the implicit reward of each
group's better samples (loss falls on a fixed rollout), trains end to end with the ODE sampler and
resumes exactly, and refuses groups of unequal size."""
import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import Config
from flowrl.errors import ConfigError
from flowrl.trainers.config_text import apply_overrides
from flowrl.trainers.online import OnlineTrainer, train
from flowrl.updates.preference import grouped


def _cfg(path, loss, **extra):
    d = yaml.safe_load(open("recipes/digits.yaml"))
    d["sampler"] = {"name": "ode", "group_size": 4, "num_steps": 4}
    ov = [o for o in tiny_train_overrides(path, **{"train.loss": loss, "train.loss_options": "{}", "train.lr": 1e-2,
                                                   "train.grad_accum": 1, **extra}) if not o.startswith("sampler.")]
    return Config.from_dict(apply_overrides(d, ov))


@pytest.mark.parametrize("loss", ["dpo", "gdro"])
def test_update_lowers_its_loss_on_a_fixed_rollout(tiny_digits_dir, tmp_path, loss):
    tr = OnlineTrainer(_cfg(tiny_digits_dir, loss, **{"train.loss_options.beta": 50.0}), tmp_path / "run")
    tr.setup()
    rollout = tr.sampler(tr.policy, tr._iteration_prompts(0), tr.reward, seed=1)
    first, _ = tr.train_on(rollout, 0)
    for _ in range(6):
        last, _ = tr.train_on(rollout, 0)  # same (t, eps): a fixed objective
    assert first["zero_var_fraction"] < 1 and first["transitions_trained"] > 0
    assert last["pref_loss"] < first["pref_loss"] and last["margin"] > first["margin"]
    tr.acc.end_training()


def test_online_dpo_trains_and_resumes_exactly(tiny_digits_dir, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(tiny_digits_dir, "dpo", **{"train.iterations": 3}), full)
    train(_cfg(tiny_digits_dir, "dpo", **{"train.iterations": 2}), part)
    train(_cfg(tiny_digits_dir, "dpo", **{"train.iterations": 3}), part, resume=True)
    a = load_file(str(list_checkpoints(full / "checkpoints")[-1] / "trainable.safetensors"))
    b = load_file(str(list_checkpoints(part / "checkpoints")[-1] / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in a.items())
    recs = [json.loads(l) for l in (full / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert len(recs) == 3 and all("pref_loss" in r and "top1_accuracy" in r for r in recs)


def test_unequal_groups_are_refused():
    ro = SimpleNamespace(group_index=torch.tensor([0, 0, 0, 1, 1]))
    with pytest.raises(ValueError, match="groups of equal size"):
        grouped(ro)
    assert grouped(SimpleNamespace(group_index=torch.tensor([1, 0, 1, 0]))).tolist() == [[1, 3], [0, 2]]


def test_bad_preference_settings(tiny_digits_dir):
    with pytest.raises(ConfigError, match="train.loss: unknown update 'ppo'.*Valid updates: .*dpo, .*gdro, grpo"):
        _cfg(tiny_digits_dir, "ppo")
    with pytest.raises(ConfigError, match="beta must be > 0"):
        _cfg(tiny_digits_dir, "dpo", **{"train.loss_options.beta": 0})
    with pytest.raises(ConfigError, match=r"unknown key train\.pref_beta\. It is an option of the update now: "
                                          r"train\.loss_options\.beta \(train\.loss: dpo / gdro\)"):
        _cfg(tiny_digits_dir, "dpo", **{"train.pref_beta": 2.0})
