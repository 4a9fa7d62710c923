import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_train_overrides
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.errors import ConfigError
from flowrl.trainers.steps import TrainingStopped
from flowrl.trainers.online import OnlineTrainer, train

RECIPE = "recipes/digits.yaml"


def _cfg(path, **extra):
    return load_config(RECIPE, tiny_train_overrides(path, **extra))


def _weights(run):
    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "trainable.safetensors"))


def test_few_steps_change_lora_and_log(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    summary = train(_cfg(tiny_digits_dir, **{"train.lr": 1e-2, "train.grad_accum": 8}), run)  # 1 step/iteration
    w = _weights(run)
    assert w and all("lora" in k for k in w)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())  # B starts at 0
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "reward_mean" in r]
    assert [r["iteration"] for r in train_recs] == [0, 1, 2]
    for r in train_recs:
        assert all(k in r for k in ("loss", "kl", "clip_fraction", "zero_var_fraction", "rollout_seconds",
                                    "reward_seconds", "update_seconds", "reward_std"))
        assert r["compile/recompiles"] == 0  # model.compile off: logged all the same
        assert torch.isfinite(torch.tensor(r["loss"]))
    assert abs(train_recs[0]["ratio_mean"] - 1) < 1e-4  # first update: new == old policy
    assert summary["iterations_done"] == 3
    for f in ("reward_curve.png", "before_after.png", "summary.json", "config.yaml"):
        assert (run / f).exists(), f
    assert any("real/hf_energy" in r for r in recs)


def test_exact_resume(tiny_digits_dir, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(tiny_digits_dir, **{"train.iterations": 4, "train.lr": 1e-2}), full)
    train(_cfg(tiny_digits_dir, **{"train.iterations": 2, "train.lr": 1e-2}), part)
    train(_cfg(tiny_digits_dir, **{"train.iterations": 4, "train.lr": 1e-2}), part, resume=True)
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    its = [json.loads(l)["iteration"] for l in (part / "metrics.jsonl").read_text().splitlines()
           if "reward_mean" in l]
    assert its == [0, 1, 2, 3]  # no duplicated iterations after resume


def test_output_dir_holding_another_run(tiny_digits_dir, tmp_path):
    run = tmp_path / "run"
    train(_cfg(tiny_digits_dir, **{"train.iterations": 1}), run)
    with pytest.raises(ConfigError, match="already holds a run.*--resume"):
        OnlineTrainer(_cfg(tiny_digits_dir), run)
    with pytest.raises(ConfigError, match=r"train\.lr"):
        OnlineTrainer(_cfg(tiny_digits_dir, **{"train.lr": 0.5}), run, resume=True)


def test_a_reward_that_scores_nothing_stops_the_first_iteration(tiny_digits_dir, tmp_path):
    """All-NaN rewards train nothing (every group has zero variance: no minibatch, no step to skip), so the
    update's non-finite guard never sees them: the run stops at its first iteration, weights untouched."""
    class NaNReward:
        name = "nan_reward"

        def __call__(self, images, prompts, **meta):
            return torch.full((images.shape[0],), float("nan"))

    run = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"iteration 0: all 16 rewards are NaN/inf \(from the first iteration "
                                              r"on\): reward nan_reward scored no sample.*choose data\.prompts"):
        OnlineTrainer(_cfg(tiny_digits_dir, **{"train.iterations": 2}), run, reward=NaNReward()).train()  # an object
    assert list_checkpoints(run / "checkpoints") == []  # nothing trained, nothing saved
    assert not any("reward_mean" in l for l in (run / "metrics.jsonl").read_text().splitlines())


def test_nonfinite_loss_skips_then_stops(tiny_digits_dir, tmp_path):
    from flowrl.pipelines import build_policy

    policy = build_policy("digits", str(tiny_digits_dir), device="cpu")
    sampling_velocity = policy.velocity
    # a policy object whose training forwards (gradients on) are NaN: every loss is NaN, rollouts are fine
    policy.velocity = lambda x, s, c: sampling_velocity(x, s, c) * (float("nan") if torch.is_grad_enabled() else 1.0)
    run = tmp_path / "run"
    cfg = _cfg(tiny_digits_dir, **{"train.max_consecutive_skips": 3, "train.iterations": 5})  # 2 steps/iteration
    with pytest.raises(TrainingStopped, match="non-finite"):
        OnlineTrainer(cfg, run, policy=policy).train()
    ck = list_checkpoints(run / "checkpoints")
    assert ck  # checkpoints before the stop are intact
    w = load_file(str(ck[-1] / "trainable.safetensors"))
    assert any("lora_B" in k for k in w)
    assert all(torch.all(v == 0) for k, v in w.items() if "lora_B" in k)  # no NaN step was applied


@pytest.mark.parametrize("recipe,extra", [
    ("recipes/digits_branch.yaml", {"sampler.num_steps": 4, "sampler.split_steps": "[0, 1]", "train.batch_size": 8,
                                    "sampler.group_size": None}),
    ("recipes/digits_tempflow.yaml", {"sampler.num_steps": 3, "sampler.branch_steps": "[0, 1]",
                                      "sampler.branches": 2, "sampler.seeds_per_prompt": 2, "train.batch_size": 8,
                                      "sampler.group_size": None}),
])
def test_tree_and_tempflow_samplers_train(tiny_digits_dir, tmp_path, recipe, extra):
    ov = [o for o in tiny_train_overrides(tiny_digits_dir, **{"train.lr": 1e-2, "train.iterations": 2, **extra})
          if not o.startswith("sampler.group_size")]
    run = tmp_path / "run"
    train(load_config(recipe, ov), run)
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert len(recs) == 2 and all(r["transitions_trained"] > 0 for r in recs)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in _weights(run).items())


def test_sample_and_eval_commands_on_a_run(tiny_digits_dir, tmp_path):
    from flowrl.cli import main

    run = tmp_path / "run"
    train(_cfg(tiny_digits_dir, **{"train.iterations": 1}), run)
    png = tmp_path / "s.png"
    assert main(["sample", "--run", str(run), "--prompts", "a handwritten digit 1", "a handwritten digit 2",
                 "--per-prompt", "2", "--steps", "3", "--out", str(png)]) == 0
    from PIL import Image

    assert Image.open(png).size[0] > 2 * 16
    out = tmp_path / "e.json"
    assert main(["eval", "--run", str(run), "--per-prompt", "2", "--steps", "3", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["samples"] == 20 and 0 <= res["reward_mean"] <= 1
    assert main(["eval", "--run", str(tmp_path / "nope"), "--per-prompt", "2"]) == 2  # clear error, exit 2


def test_the_trainer_takes_policy_reward_and_sampler_objects(tiny_digits_dir, tmp_path):
    from flowrl.pipelines import build_policy
    from flowrl.rollout.group import GroupSampler

    policy = build_policy("digits", str(tiny_digits_dir), device="cpu")
    sampler = GroupSampler(group_size=2, num_steps=3)  # the config's sampler: group_size 4, 4 steps
    scored = []

    def brightness(images, prompts, **meta):  # a plain function is a reward
        scored.append(len(prompts))
        return images.float().mean(dim=(1, 2, 3))

    tr = OnlineTrainer(_cfg(tiny_digits_dir, **{"train.iterations": 1, "logging.eval_every": 5}), tmp_path / "run",
                       policy=policy, reward=brightness, sampler=sampler)
    tr.train()
    assert tr.policy is policy and tr.sampler is sampler and tr.reward is brightness
    assert tr.prompts_per_iteration == 8  # train.batch_size 16 over the object's 2 samples per prompt
    rec = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "reward_mean" in l]
    assert rec[0]["model_evals"] == 16 * 3 and 16 in scored  # the object's rollout, scored by the object
    with pytest.raises(ConfigError, match="multiple of the sampler's 3 samples per prompt"):
        OnlineTrainer(_cfg(tiny_digits_dir), tmp_path / "run2", policy=policy,
                      sampler=GroupSampler(group_size=3, num_steps=2)).setup()
    from flowrl.rollout.ode import ODEGroupSampler

    with pytest.raises(ConfigError, match="'ODEGroupSampler' sampler .* stores no stochastic transitions"):
        OnlineTrainer(_cfg(tiny_digits_dir), tmp_path / "run3", policy=policy,
                      sampler=ODEGroupSampler(group_size=4, num_steps=2)).setup()  # GRPO needs transitions
