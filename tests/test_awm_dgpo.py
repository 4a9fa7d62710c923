"""AWM (``train.loss: awm``) and DGPO (``train.loss: dgpo``) through the one trainer: each trains on
finished samples, keeps its EMA copy across iterations and resumes exactly (weights and copy), refuses
bad options in one line when the recipe loads, and its digits recipe raises the evaluation reward."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.errors import ConfigError
from flowrl.trainers.config import Config, load_config
from flowrl.trainers.config_text import apply_overrides
from flowrl.trainers.online import train

# the options each test run uses: every EMA path on (AWM: EMA KL and off-policy sampling from the EMA
# weights; DGPO: the DSM clip and sampling from the EMA old policy after the first step)
TINY = {"awm": ("ema_policy", "{time_sampling: discrete_wo_init, num_times: 2, weighting: ghuber, clip_range: 1.0, "
                              "adv_clip: 1.0, beta_kl: 0.01, beta_ema_kl: 1.0, off_policy: true}"),
        "dgpo": ("old_policy", "{num_times: 2, time_range: 0.9, beta_dpo: 100.0, clip_range: 0.01, beta_kl: 0.01, "
                               "switch_ema_ref: 0}")}


def _cfg(model_dir, loss, sampler="{name: ode, group_size: 4, num_steps: 4}", **extra):
    d = yaml.safe_load(open(f"recipes/digits_{loss}.yaml"))
    d["sampler"] = yaml.safe_load(sampler)
    ov = [o for o in tiny_train_overrides(model_dir, **{"train.loss_options": TINY[loss][1], "train.lr": 1e-2,
                                                        "train.minibatch_size": 16, "train.grad_accum": 2, **extra})
          if not o.startswith("sampler.")]
    return Config.from_dict(apply_overrides(d, ov))


def _tensors(run, copy):
    ck = list_checkpoints(run / "checkpoints")[-1]
    return load_file(str(ck / "trainable.safetensors")), load_file(str(ck / f"extra_{copy}.safetensors"))


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]


@pytest.mark.parametrize("loss", ["awm", "dgpo"])
def test_trains_on_ode_samples_keeps_its_ema_copy_and_resumes_exactly(tiny_digits_dir, tmp_path, loss):
    copy = TINY[loss][0]
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(tiny_digits_dir, loss, **{"train.iterations": 3}), full)
    recs = _records(full)
    assert len(recs) == 3 and all(r["transitions_trained"] == 32 and r["skipped_steps"] == 0 for r in recs)
    w, ema = _tensors(full, copy)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())
    assert ema.keys() == w.keys() and any(not torch.equal(w[k], ema[k]) for k in w)  # the copy lags behind theta
    if loss == "awm":  # moved once per iteration after its update, decay min(0.3, 0.001 iteration)
        assert [r["awm/ema_decay"] for r in recs] == pytest.approx([0.0, 0.001, 0.002])
        assert all(r["ema_kl"] >= 0 for r in recs) and recs[-1]["ema_kl"] > 0
    else:  # moved after every step (one per iteration), decay min(0.3, 0.001 s), s the steps before it
        assert [r["dgpo/old_decay"] for r in recs] == pytest.approx([0.0, 0.001, 0.002])
        assert [r["dgpo/sampling_from_old"] for r in recs] == [0.0, 1.0, 1.0]
        assert all(r["preference_loss"] > 0 for r in recs)
    train(_cfg(tiny_digits_dir, loss, **{"train.iterations": 1}), part)
    train(_cfg(tiny_digits_dir, loss, **{"train.iterations": 3}), part, resume=True)
    w2, ema2 = _tensors(part, copy)
    assert all(torch.equal(w[k], w2[k]) and torch.equal(ema[k], ema2[k]) for k in w)
    assert [r["loss"] for r in _records(part)] == [r["loss"] for r in recs]


@pytest.mark.parametrize("loss", ["awm", "dgpo"])
def test_trains_on_the_finished_samples_of_a_stochastic_sampler_too(tiny_digits_dir, tmp_path, loss):
    sde = "{name: group, group_size: 4, num_steps: 4, step: sde, noise_level: 0.7}"
    train(_cfg(tiny_digits_dir, loss, sampler=sde, **{"train.iterations": 1}), tmp_path / "run")
    (rec,) = _records(tmp_path / "run")
    assert rec["transitions_trained"] == 32 and rec["grad_norm"] > 0


def test_dgpo_raises_the_preference_of_each_groups_better_half_on_a_fixed_rollout(tiny_digits_dir, tmp_path):
    from flowrl.trainers.online import OnlineTrainer

    cfg = _cfg(tiny_digits_dir, "dgpo", **{"train.loss_options": "{num_times: 2, time_range: 0.9, beta_dpo: 100.0, "
                                                                 "clip_dsm: false}", "train.grad_accum": 1})
    tr = OnlineTrainer(cfg, tmp_path / "run")
    tr.setup()
    rollout = tr.sampler(tr.policy, tr._iteration_prompts(0), tr.reward, seed=1)
    first, _ = tr.train_on(rollout, 0)
    for _ in range(5):
        last, _ = tr.train_on(rollout, 0)  # the same times and noise: a fixed objective
    assert first["zero_var_fraction"] < 1 and first["transitions_trained"] == 32
    assert last["preference_loss"] < first["preference_loss"], (first["preference_loss"], last["preference_loss"])
    tr.acc.end_training()


SOL_KEEP_ONE = "sampler={name: sol, explore_backend: none, pool_size: 8, keep: 1, preview_steps: 2, regen: ode}"
# (recipe, overrides, what the one-line error must say): refused when the recipe loads, before any model
REFUSED = {
    "an unknown weighting": ("digits_awm", ["train.loss_options.weighting=l2"],
                             "train.loss_options.weighting must be one of uniform, t, t2, huber, ghuber, got 'l2'"),
    "an unknown time sampling": ("digits_awm", ["train.loss_options.time_sampling=cosine"],
                                 "train.loss_options.time_sampling must be one of logit_normal, uniform, discrete"),
    "no training times": ("digits_dgpo", ["train.loss_options.num_times=0"],
                          "train.loss_options.num_times must be a positive integer, got 0"),
    "an empty time range": ("digits_awm", ["train.loss_options.time_range=[0.5, 0.2]"],
                            "train.loss_options.time_range"),
    "a clip range backwards": ("digits_awm", ["train.loss_options.clip_range=[0.1, -0.1]"],
                               "train.loss_options.clip_range must be a scalar c (meaning [-c, c]) or [lo, hi]"),
    "an EMA decay of 1": ("digits_awm", ["train.loss_options.ema_max_decay=1.0"],
                          "train.loss_options.ema_max_decay must be in [0, 1), got 1.0"),
    "an EMA ramp without an EMA copy": ("digits_awm", ["train.loss_options.beta_ema_kl=0", "train.loss_options.ema_ramp=0.01"],
                                       "train.loss_options.ema_ramp sets the EMA copy, which train.loss=awm keeps only "
                                       "with beta_ema_kl > 0 or off_policy: true"),
    "off_policy not a bool": ("digits_awm", ["train.loss_options.off_policy=yes please"],
                              "train.loss_options.off_policy must be true or false"),
    "a zero preference scale": ("digits_dgpo", ["train.loss_options.beta_dpo=0"],
                                "train.loss_options.beta_dpo must be a number > 0, got 0"),
    "a negative switch step": ("digits_dgpo", ["train.loss_options.switch_ema_ref=-1"],
                               "train.loss_options.switch_ema_ref must be an integer >= 0"),
    "a switch without an old policy": ("digits_dgpo", ["train.loss_options.clip_dsm=false",
                                                       "train.loss_options.switch_ema_ref=10"],
                                       "train.loss_options.switch_ema_ref needs the EMA old policy"),
    "GRPO's options for AWM": ("digits_awm", ["train.loss_options.kl_form=exact"],
                               "train.loss_options.kl_form: not an option of train.loss='awm'"),
    "AWM's options for DGPO": ("digits_dgpo", ["train.loss_options.weighting=t"],
                               "train.loss_options.weighting: not an option of train.loss='dgpo'"),
    "DGPO on groups of one": ("digits_dgpo", [SOL_KEEP_ONE], "keep must be an integer >= 2 (a group of one has no advantage"),
    "AWM in offline mode": ("digits_gdro", ["train.loss=awm", "train.loss_options={}"],
                            "train.loss=awm trains on rollouts"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_options_fail_in_one_line_when_the_recipe_loads(case):
    recipe, overrides, reason = REFUSED[case]
    with pytest.raises(ConfigError) as e:
        load_config(recipe, overrides)
    msg = str(e.value)
    assert reason in msg and "\n" not in msg, msg


@pytest.mark.parametrize("recipe, overrides", [
    ("digits", ["train.loss=awm", "train.loss_options={}"]),  # AWM on the SDE samples of the group sampler
    ("digits_branch", ["train.loss=awm", "train.loss_options={}"]),  # ... on a tree's leaves
    ("digits_sol_nft", ["train.loss=dgpo", "train.loss_options={}"]),  # DGPO on Sol's regenerated groups
    ("digits_awm", ["train.loss_options.time_range=[0.1, 0.8]", "train.loss_options.adv_clip=[-2, 1]"]),
    ("digits_dgpo", ["train.loss_options={use_ema_ref: true, clip_dsm: false, beta_dpo: 2000.0}"]),
])
def test_possible_combinations_load(recipe, overrides):
    cfg = load_config(recipe, overrides)
    assert cfg.train.loss in ("awm", "dgpo") and cfg.train.update_needs.clean_samples


def test_the_dynamic_reference_needs_no_frozen_model_without_a_kl():
    needs = load_config("digits_dgpo", ["train.loss_options={use_ema_ref: true, beta_kl: 0}"]).train.update_needs
    assert not needs.reference and needs.copies == ("old_policy",)
    needs = load_config("digits_awm", ["train.loss_options={off_policy: true}"]).train.update_needs
    assert not needs.reference and needs.copies == ("ema_policy",)


@pytest.mark.parametrize("loss, iterations", [("awm", 6), ("dgpo", 6)])
def test_the_digits_recipe_raises_the_evaluation_reward(pretrained_digits_base, tmp_path, loss, iterations):
    cfg = load_config(f"recipes/digits_{loss}.yaml", [
        f"train.iterations={iterations}", "logging.trackers=[]", "logging.progress=false",
        f"logging.eval_every={iterations}", "reward.heldout={}", "train.checkpoint_every=100"])
    summary = train(cfg, tmp_path / "run")
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    assert after > before + 0.03, (before, after)
    assert summary["skipped_steps"] == 0


@pytest.mark.parametrize("recipe, copy", [("sd3_awm_pickscore", "ema policy of train.loss=awm"),
                                          ("flux_awm_pickscore", "ema policy of train.loss=awm"),
                                          ("sd3_dgpo_pickscore", "old policy of train.loss=dgpo"),
                                          ("flux_dgpo_pickscore", "old policy of train.loss=dgpo")])
def test_the_gpu_recipes_fit_8_x_80_gib_with_their_copy(recipe, copy):
    from flowrl.plan.core import GiB, plan_memory

    p = plan_memory(load_config(f"recipes/{recipe}.yaml"), 8, 80 * GiB, recipe)
    assert p.fits, (recipe, p.peak_bytes / GiB)
    assert any(i.name.startswith(copy) for i in p.items), [i.name for i in p.items]
