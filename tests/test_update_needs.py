"""Updates own their options and declare what they need (flowrl.updates.base); config validation refuses a
combination an update cannot run when the recipe is loaded, before any model loads, in one line with the fix."""
from __future__ import annotations

import dataclasses

import pytest

from flowrl.errors import ConfigError
from flowrl.trainers.config import load_config
from flowrl.updates import UPDATES, updates_by_input

ODE = "sampler={name: ode, group_size: 8, num_steps: 4}"
SOL_ODE = "sampler={name: sol, explore_backend: none, pool_size: 8, keep: 4, preview_steps: 2, regen: ode}"

# (recipe, overrides, what the one-line error must say)
IMPOSSIBLE = {
    "grpo_guard on an ODE sampler": (
        "digits", ["train.loss=grpo_guard", ODE],
        "'ode' sampler (as configured) stores no stochastic transitions, so train.loss=grpo_guard would have nothing"),
    "grpo on an ODE sampler": ("digits", [ODE], "stores no stochastic transitions, so train.loss=grpo"),
    "grpo on Sol regenerating by ODE": ("digits", [SOL_ODE], "'sol' sampler (as configured) stores no stochastic"),
    "grpo_guard on Sol regenerating by ODE": ("digits", ["train.loss=grpo_guard", SOL_ODE],
                                              "train.loss=grpo_guard would have nothing to train on"),
    "an online loss in offline mode": ("digits_gdro", ["train.loss=grpo", "train.loss_options={}"],
                                       "train.mode=offline trains on a dataset, and train.loss=grpo trains on rollouts: "
                                       "use train.loss=offline_gdro"),
    "DiffusionNFT in offline mode": ("digits_gdro", ["train.loss=nft", "train.loss_options={}"],
                                     "train.loss=nft trains on rollouts"),
    "online GDRO in offline mode": ("digits_gdro", ["train.loss=gdro", "train.loss_options={}"],
                                    "train.loss=gdro trains on rollouts"),
    "the offline loss online": ("digits", ["train.loss=offline_gdro", "train.loss_options={}", "train.beta_kl=0"],
                                "train.loss=offline_gdro trains on a dataset from `flowrl generate-offline`: set "
                                "train.mode=offline"),
    "a KL weight for DPO (no KL term)": ("digits", ["train.loss=dpo", "train.loss_options={}", ODE],
                                         "train.beta_kl=0.04 has no effect with train.loss=dpo"),
    "a KL weight for online GDRO": ("digits", ["train.loss=gdro", "train.loss_options={}", ODE],
                                    "train.beta_kl=0.04 has no effect with train.loss=gdro"),
    "a KL weight for offline GDRO": ("digits_gdro", ["train.beta_kl=0.1"],
                                     "train.beta_kl=0.1 has no effect with train.loss=offline_gdro"),
    "per-reward normalisation for DiffusionNFT": ("digits_sol_nft", ["reward.aggregate=per_reward"],
                                                  "reward.aggregate=per_reward has no effect with train.loss=nft"),
    "per-reward normalisation for DPO": ("digits", ["train.loss=dpo", "train.loss_options={}", "train.beta_kl=0",
                                                    "reward.aggregate=per_reward", ODE],
                                         "reward.aggregate=per_reward has no effect with train.loss=dpo"),
    "inner epochs in offline mode": ("digits_gdro", ["train.inner_epochs=2"],
                                     "train.inner_epochs=2 has no effect in offline mode"),
    "GRPO's options for DiffusionNFT": ("digits", ["train.loss=nft", "train.loss_options.clip_range=0.1"],
                                        "train.loss_options.clip_range: not an option of train.loss='nft'"),
    "DiffusionNFT's options for GRPO": ("digits", ["train.loss_options={beta: 2.0}"],
                                        "train.loss_options.beta: not an option of train.loss='grpo'"),
    "an advantage option the update sets": ("digits", ["train.loss_options.advantage_options={adv_clip: 10}"],
                                            "advantage_options.adv_clip: the update sets it; use train.adv_clip_max"),
    "FSDP with fp16": ("digits", ["train.sharding=fsdp", "train.mixed_precision=fp16"],
                       "train.sharding=fsdp supports train.mixed_precision 'no' or 'bf16'"),
    "CPU offload without FSDP": ("digits", ["train.cpu_offload=true"], "train.cpu_offload=true needs train.sharding=fsdp"),
    "LoRA targets on a full fine-tune": ("digits", ["train.lora_rank=0", "train.lora_targets=[to_q]"],
                                         "train.lora_targets names LoRA targets, but train.lora_rank=0"),
    "options of a reward not trained on": ("digits", ["reward.options={jpeg_compressibility: {}}"],
                                           "reward.options.jpeg_compressibility: 'jpeg_compressibility' is not in "
                                           "reward.weights"),
    "text encoders dropped without a cache": ("digits", ["model.drop_text_encoders=true"],
                                              "model.drop_text_encoders=true needs model.text_embedding_cache"),
    "a batch that does not split into groups": ("digits", ["train.batch_size=81"],
                                                "not a multiple of the sampler's 8 samples per prompt"),
    "a moved key: DiffusionNFT's beta": ("digits_sol_nft", ["train.nft_beta=2.0"],
                                         "unknown key train.nft_beta. It is an option of the update now: "
                                         "train.loss_options.beta (train.loss: nft)"),
    "a moved key: GDRO's beta": ("digits_gdro", ["offline.beta=3.0"],
                                 "unknown key offline.beta. It is an option of the update now: train.loss_options.beta "
                                 "(train.loss: offline_gdro)"),
    "a moved key: the clip range": ("digits", ["train.clip_range=0.2"],
                                    "train.loss_options.clip_range (train.loss: grpo / grpo_guard)"),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_combinations_fail_at_config_time(case):
    recipe, overrides, reason = IMPOSSIBLE[case]
    with pytest.raises(ConfigError) as e:
        load_config(recipe, overrides)
    msg = str(e.value)
    assert reason in msg, msg
    assert "\n" not in msg  # one line


@pytest.mark.parametrize("recipe, overrides", [
    ("digits", ["train.loss=grpo_guard"]),  # GRPO-Guard on SDE transitions, with GRPO's options
    ("digits", ["train.loss=nft", "train.loss_options={}", ODE]),  # DiffusionNFT on ODE samples, with a KL term
    ("digits", ["train.loss=dpo", "train.loss_options={}", "train.beta_kl=0", ODE]),
    ("digits", ["train.loss=gdro", "train.loss_options={beta: 6.0, tau: 0.0}", "train.beta_kl=0", SOL_ODE]),
    ("digits", ["reward.aggregate=per_reward"]),  # GRPO normalises each reward apart
    ("digits_gdro", ["reward.aggregate=per_reward"]),  # so does offline GDRO's ranking
    ("digits_gdro", ["train.loss=null"]),  # no loss named: the mode's (offline_gdro)
])
def test_possible_combinations_load(recipe, overrides):
    cfg = load_config(recipe, overrides)
    assert cfg.train.loss in UPDATES


def test_every_update_declares_what_it_needs():
    by_input = updates_by_input()
    assert by_input == {"rollout": ["grpo", "nft", "dpo", "gdro", "grpo_guard"], "dataset": ["offline_gdro"]}
    on_transitions = {n for n in UPDATES.entries if UPDATES.get(n).needs_transitions}
    assert on_transitions == {"grpo", "grpo_guard"}
    with_kl = {n for n in UPDATES.entries if UPDATES.get(n).kl_term}
    assert with_kl == {"grpo", "grpo_guard", "nft"}
    assert {n for n in UPDATES.entries if UPDATES.get(n).keeps_old_policy} == {"nft"}
    train = load_config("digits").train
    kl_on, kl_off = train, dataclasses.replace(train, beta_kl=0.0)
    refs = {n: (UPDATES.get(n).needs_reference(kl_on), UPDATES.get(n).needs_reference(kl_off)) for n in UPDATES.entries}
    assert refs == {"grpo": (True, False), "grpo_guard": (True, False), "nft": (True, False), "dpo": (True, True),
                    "gdro": (True, True), "offline_gdro": (True, True)}


def test_each_gdro_beta_is_set_one_way():
    online = load_config("digits", ["train.loss=gdro", "train.loss_options={beta: 3.0}", "train.beta_kl=0", ODE])
    offline = load_config("digits_gdro", ["train.loss_options.beta=3.0"])
    assert online.effective_loss_options()["beta"] == 3.0 and offline.effective_loss_options()["beta"] == 3.0
    assert not hasattr(online.train, "pref_beta") and not hasattr(offline.offline, "beta")


def test_the_mode_picks_the_default_loss():
    assert load_config("digits").train.loss == "grpo"
    assert load_config("digits_gdro", ["train.loss=null"]).train.loss == "offline_gdro"


def test_prompts_per_iteration_builds_no_sampler(monkeypatch):
    cfg = load_config("digits")
    monkeypatch.setattr(type(cfg.sampler), "build", lambda self: pytest.fail("a sampler was built again"))
    assert cfg.prompts_per_iteration == 10 and cfg.sampler.samples_per_prompt == 8
