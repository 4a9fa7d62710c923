"""SFT (``train.loss: sft`` / ``train.mode: sft``) and offline Diffusion-DPO (``train.loss: dpo_offline``): their
datasets (images with prompts, preference pairs), ``flowrl make-pairs``, the DPO formula, exact resume, and the
digits recipes measurably doing what they are for (slow)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_train_overrides


def _png(path, value: int = 128, size: int = 16):
    from flowrl.utils.io import save_png

    save_png(np.full((size, size, 3), value, dtype=np.uint8), path)


# ---------------------------------------------------------------- the datasets
def test_image_sets_read_every_layout(tmp_path):
    from flowrl.data.image_sets import ImageDataset, PairDataset
    from flowrl.data.items import PromptItem

    for name, v in (("a.png", 0), ("b.png", 255), ("s.png", 64)):
        _png(tmp_path / name, v)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "p a", "image": "a.png"}\n'
                                         '{"caption": "p b", "file_name": "b.png", "source": "s.png"}\n')
    ds = ImageDataset(tmp_path / "rows.jsonl")
    prompts, images = ds.read([1, 0])
    assert len(ds) == 2 and images.shape == (2, 3, 16, 16)
    assert isinstance(prompts[0], PromptItem) and prompts[0].prompt == "p b" and prompts[1] == "p a"
    assert images[0].min() == 1.0 and images[1].max() == 0.0
    assert torch.equal(ds.epoch_order(0, 1), ds.epoch_order(0, 1)) and sorted(ds.epoch_order(0, 1).tolist()) == [0, 1]
    folder = tmp_path / "captions"  # images with .txt captions beside them
    folder.mkdir()
    _png(folder / "x.png")
    (folder / "x.txt").write_text("a caption\n")
    assert ImageDataset(folder).read([0])[0] == ["a caption"]
    (tmp_path / "pairs.jsonl").write_text(
        '{"prompt": "p", "chosen": "a.png", "rejected": "b.png"}\n'
        '{"caption": "q", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0}\n'  # Pick-a-Pic: jpg_1 preferred
        '{"caption": "tie", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 0.5}\n')  # left out
    pairs = PairDataset(tmp_path)  # a folder holding pairs.jsonl
    prompts, win, lose = pairs.read([0, 1])
    assert len(pairs) == 2 and pairs.ties == 1 and prompts == ["p", "q"]
    assert win[0].max() == 0.0 and lose[0].min() == 1.0 and win[1].min() == 1.0 and lose[1].max() == 0.0


def test_image_set_errors_name_the_fix(tmp_path):
    from flowrl.data.image_sets import open_image_set
    from flowrl.errors import ConfigError

    with pytest.raises(ConfigError, match="data.dataset .* not found"):
        open_image_set("images", tmp_path / "none.jsonl")
    (tmp_path / "a.jsonl").write_text('{"prompt": "p"}\n')
    with pytest.raises(ConfigError, match=r"a.jsonl:1: needs a non-empty image field \(image or file_name\)"):
        open_image_set("images", tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text('{"prompt": "p", "chosen": "a.png"}\n')
    with pytest.raises(ConfigError, match="rejected image field"):
        open_image_set("pairs", tmp_path / "b.jsonl")
    _png(tmp_path / "lonely.png")
    with pytest.raises(ConfigError, match="no caption lonely.txt"):
        open_image_set("images", tmp_path)


def test_digits_materialize_offline_once(tmp_path):
    from flowrl.data.digits import digits_dataset
    from flowrl.data.image_sets import ImageDataset, materialize_digits

    path = materialize_digits(tmp_path / "d", "test")
    ds = ImageDataset(path)
    x, y = digits_dataset("test")
    prompts, images = ds.read([0, 5])
    assert len(ds) == len(y) and prompts[1] == f"a handwritten digit {int(y[5])}"
    assert (images[:, :1] * 2 - 1 - x[[0, 5]]).abs().max() < 1 / 255 + 1e-6  # 8-bit PNGs of the real digits
    assert materialize_digits(tmp_path / "d", "test") == path  # written once


# ---------------------------------------------------------------- the configuration
def test_train_mode_sft_is_offline_sft_and_loss_names():
    from flowrl.errors import ConfigError
    from flowrl.trainers.config import load_config
    from flowrl.updates import updates_by_input

    cfg = load_config("digits_sft.yaml")
    assert (cfg.train.mode, cfg.train.loss, cfg.train.update_needs.data) == ("offline", "sft", "images")
    cfg = load_config("digits_dpo_offline.yaml")
    assert cfg.train.update_needs.data == "pairs" and cfg.train.update_needs.reference
    assert {"sft", "dpo_offline", "offline_gdro"} <= set(updates_by_input()["dataset"])
    with pytest.raises(ConfigError, match="train.mode=sft trains train.loss=sft"):
        load_config("digits_sft.yaml", ["train.loss=grpo"])
    with pytest.raises(ConfigError, match="train.loss_options.beta must be a number > 0"):
        load_config("digits_dpo_offline.yaml", ["train.loss_options.beta=0"])


# ---------------------------------------------------------------- the DPO formula
def test_dpo_offline_loss_is_diffusion_dpo():
    """The authors' loss (arXiv 2311.12908, their train.py): -log sigmoid(-beta/2 ((e_w - e_l) - (r_w - r_l)))."""
    from flowrl.updates.dpo_offline import dpo_offline_loss

    g = torch.Generator().manual_seed(0)
    err, ref = torch.rand(5, 2, generator=g), torch.rand(5, 2, generator=g)
    beta = 7.0
    want = -F.logsigmoid(-0.5 * beta * ((err[:, 0] - err[:, 1]) - (ref[:, 0] - ref[:, 1]))).mean()
    got, s = dpo_offline_loss(err, ref, beta)
    assert torch.allclose(got, want) and s.shape == (5, 2)
    e = err.clone().requires_grad_(True)
    dpo_offline_loss(e, ref, beta)[0].backward()
    assert (e.grad[:, 0] > 0).all() and (e.grad[:, 1] < 0).all()  # lower the preferred error, raise the rejected
    assert torch.allclose(dpo_offline_loss(ref, ref, beta)[0], torch.tensor(math.log(2.0)))  # at the reference


# ---------------------------------------------------------------- make-pairs and training on a tiny model
def _gen_cfg(model_dir, dataset, **extra):
    from flowrl.trainers.config import load_config

    ov = {"offline.dataset": str(dataset), "offline.groups_per_prompt": 2, "offline.groups_per_shard": 6,
          "offline.k": 3, "offline.num_steps": 3, "reward.weights": "{jpeg_compressibility: 1.0}",
          "data.eval_prompts": "[a handwritten digit 1, a handwritten digit 2]", **extra}
    return load_config("digits_dpo_offline.yaml", tiny_train_overrides(model_dir, **ov))


@pytest.fixture(scope="module")
def tiny_pairs(tiny_digits_dir, tmp_path_factory):
    """A generate-offline dataset of the tiny model (20 groups of 3) and its pairs by `flowrl make-pairs`."""
    from flowrl.cli import main
    from flowrl.trainers.offline import generate_offline

    root = tmp_path_factory.mktemp("dpo")
    generate_offline(_gen_cfg(tiny_digits_dir, root / "ds"), progress=False)
    assert main(["make-pairs", "--dataset", str(root / "ds"), "--reward", "jpeg_compressibility",
                 "--out", str(root / "pairs")]) in (0, None)
    return root


def test_make_pairs_pairs_each_groups_best_and_worst(tiny_pairs):
    from flowrl.data.offline_store import OfflineDataset

    rows = [json.loads(line) for line in (tiny_pairs / "pairs" / "pairs.jsonl").read_text().splitlines()]
    col = OfflineDataset(tiny_pairs / "ds").column("jpeg_compressibility")  # [20, 3]
    assert len(rows) == 20
    for r in rows:
        g = r["group"]
        assert r["reward_chosen"] == pytest.approx(float(col[g].max())) and r["reward_chosen"] > r["reward_rejected"]
        assert r["reward_rejected"] == pytest.approx(float(col[g].min()))
        assert (tiny_pairs / "pairs" / r["chosen"]).is_file() and r["prompt"].startswith("a handwritten digit")


def _dpo_cfg(model_dir, pairs, **extra):
    ov = {"data.dataset": str(pairs), "offline.batch_groups": 5, "train.grad_accum": 2, "offline.epochs": 2,
          "offline.eval_every": 2, "train.lr": 1e-2, "train.lora_rank": 4, **extra}
    return _gen_cfg(model_dir, "unused", **ov)


def _weights(run):
    from safetensors.torch import load_file

    from flowrl.checkpoints.common import list_checkpoints

    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "trainable.safetensors"))


def test_dpo_offline_trains_and_resumes_exactly(tiny_digits_dir, tiny_pairs, tmp_path):
    from flowrl.trainers.offline import train

    pairs = tiny_pairs / "pairs"
    full = tmp_path / "full"
    summary = train(_dpo_cfg(tiny_digits_dir, pairs), full)  # 20 pairs, 5 x 2 per step: 2 steps x 2 epochs
    assert summary["steps_done"] == 4 and summary["dataset_groups"] == 20
    recs = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "dpo_loss" in r]
    assert [r["iteration"] for r in steps] == list(range(4))
    assert steps[0]["dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-4)  # the policy starts at the reference
    assert all(math.isfinite(r["loss"]) and 0 <= r["implicit_accuracy"] <= 1 for r in steps)
    part = tmp_path / "part"
    train(_dpo_cfg(tiny_digits_dir, pairs, **{"offline.max_steps": 1}), part)
    train(_dpo_cfg(tiny_digits_dir, pairs), part, resume=True)  # steps 1-3, into epoch 2
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_trains_exports_and_is_the_base_of_rl(tiny_digits_dir, tiny_pairs, tmp_path):
    """SFT on a folder of images (the generated dataset's, as --smoke makes it); the run exports, and a GRPO run with
    model.path = the SFT run starts where the SFT run ended (its trained weights, the LoRA fused)."""
    from flowrl.cli import main
    from flowrl.data.group_export import export_images
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import dataset_policy, train
    from flowrl.trainers.online import train as train_online

    policy = dataset_policy(str(tiny_pairs / "ds"))
    info = export_images(tiny_pairs / "ds", tmp_path / "images", lambda x: policy.decode(x))
    assert info["images"] == 60
    ov = tiny_train_overrides(tiny_digits_dir, **{"data.dataset": str(tmp_path / "images"), "offline.batch_groups": 8,
                                                  "offline.epochs": 1, "offline.max_steps": 3, "offline.eval_every": 3,
                                                  "train.ema": "false", "train.lora_rank": 4, "train.lr": 1e-2,
                                                  "offline.num_steps": 4,
                                                  "data.eval_prompts": "[a handwritten digit 1]"})
    summary = train(load_config("digits_sft.yaml", ov), tmp_path / "run")
    assert summary["steps_done"] == 3
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [round(r["fm_loss"], 6) > 0 for r in recs if "fm_loss" in r] == [True] * 3
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "lora")]) in (0, None)
    assert any((tmp_path / "lora").iterdir())
    # RL after SFT: model.path the SFT run directory (flowrl.checkpoints.runs): its weights, LoRA fused, are the base
    rl = load_config("digits.yaml", tiny_train_overrides(tmp_path / "run", **{
        "train.iterations": 1, "data.eval_prompts": "[a handwritten digit 1]", "logging.eval_every": 100}))
    after = train_online(rl, tmp_path / "rl")
    assert after["eval_reward_before"] == pytest.approx(summary["eval_reward_after"], abs=1e-5)
    assert after["eval_reward_before"] != pytest.approx(summary["eval_reward_before"], abs=1e-5)


def test_plan_reads_the_declarations():
    """`flowrl plan`: a pass of offline.batch_groups images (sft) or pairs of 2 (dpo_offline, with the reference
    beside the graph), and no generation working set: an image dataset is read, not sampled."""
    from flowrl.plan.core import plan_memory
    from flowrl.trainers.config import load_config

    for recipe, rows in (("digits_sft.yaml", 64), ("digits_dpo_offline.yaml", 32)):
        p = plan_memory(load_config(recipe), 1, 80 * 2**30, recipe)
        names = [i.name for i in p.items]
        assert any(n.startswith(f"activations, without gradient checkpointing ({rows} rows)") for n in names), names
        assert not any(n.startswith(("generate-offline", "rollout:")) for n in names), names


def test_bench_methods_rows_of_the_dataset_updates(tiny_digits_dir, tmp_path):
    """`flowrl bench methods` runs sft (the real digits as they are) and dpo_offline (its generated dataset and
    pairs made first, their seconds counted) on the online rows' footing; a tiny budget proves the rows."""
    from flowrl.cli import main

    extra = tiny_train_overrides(tiny_digits_dir, **{"data.eval_prompts": "[a handwritten digit 3]",
                                                     "offline.groups_per_prompt": 1, "offline.k": 2,
                                                     "offline.num_steps": 2, "offline.batch_groups": 2})
    out = tmp_path / "bench"
    assert main(["bench", "methods", "--methods", "sft,dpo_offline", "--budget", "0.2", "--eval-every", "0.2",
                 "--out", str(out), *extra]) == 0
    res = json.loads((out / "methods.json").read_text())
    assert list(res["variants"]) == ["sft", "dpo_offline"] and not res["failed"] and not res["skipped"]
    sft, dpo = res["variants"]["sft"], res["variants"]["dpo_offline"]
    assert sft["dataset_seconds"] == 0 and sft["iterations"] >= 1
    assert sft["samples_drawn"] == 4 * sft["iterations"]  # 2 images x 2 passes per step
    assert dpo["dataset_seconds"] > 0 and dpo["samples_drawn"] == 10 * 2  # 10 digits x k = 2 generated
    assert sft["curve"][0]["eval_reward"] == dpo["curve"][0]["eval_reward"]  # the same base and evaluation


# ---------------------------------------------------------------- the digits recipes (real base, slow)
def _quiet(**extra) -> list[str]:
    return [f"{k}={v}" for k, v in {"logging.trackers": "[]", "logging.progress": "false", "reward.heldout": "{}",
                                   "train.checkpoint_every": 1000, **extra}.items()]


def test_digits_dpo_offline_raises_the_reward(pretrained_digits_base, tmp_path):
    """recipes/digits_dpo_offline.yaml on 80 pairs the digits reward made of the base's own samples (8 groups of 6
    per digit, each group's best vs worst): 20 steps raise the evaluation reward."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import generate_offline, make_pairs, train

    small = {"offline.groups_per_prompt": 8, "offline.epochs": 4, "offline.eval_every": 20, "logging.eval_every": 20}
    cfg = load_config("digits_dpo_offline.yaml", _quiet(**small))
    generate_offline(cfg, str(tmp_path / "data"), progress=False)
    pairs = make_pairs(str(tmp_path / "data"), str(tmp_path / "pairs"), "digits")
    assert pairs["pairs"] == 80 and pairs["reward_chosen"] > pairs["reward_rejected"] + 0.2
    cfg = load_config("digits_dpo_offline.yaml", _quiet(**small, **{"data.dataset": pairs["path"]}))
    summary = train(cfg, tmp_path / "run")
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    assert summary["steps_done"] == 20 and after > before + 0.02, (before, after)


def test_digits_sft_moves_the_base_toward_the_real_digits(pretrained_digits_base, tmp_path):
    """recipes/digits_sft.yaml as shipped: the evaluation reward rises, and the samples' high-frequency energy and
    within-prompt diversity both move toward the held-out real digits' (the base's samples are smoother and less
    varied than real digits; docs/algorithms.md §15: logit-normal(0, 1) times raised the reward but lowered the
    diversity). Margins: train.seed 0 and 1 measured +0.028 to +0.036 reward, +0.0067 diversity."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import train

    cfg = load_config("digits_sft.yaml", _quiet())
    summary = train(cfg, tmp_path / "run")
    assert summary["steps_done"] == 660
    assert summary["eval_reward_after"] > summary["eval_reward_before"] + 0.015, summary
    for key, margin in (("hf_energy", 2e-4), ("diversity", 3e-3)):
        real, before, after = summary[f"real/{key}"], summary[f"{key}_before"], summary[f"{key}_after"]
        assert abs(after - real) < abs(before - real) - margin, (key, summary)


def test_sft_full_fine_tune_with_ema_resumes_exactly(tiny_digits_dir, tiny_pairs, tmp_path):
    """A full fine-tune with EMA stopped after 1 step and resumed ends with the uninterrupted run's weights and EMA."""
    from safetensors.torch import load_file

    from flowrl.checkpoints.common import list_checkpoints
    from flowrl.data.group_export import export_images
    from flowrl.trainers.config import load_config
    from flowrl.trainers.offline import dataset_policy, train

    policy = dataset_policy(str(tiny_pairs / "ds"))
    export_images(tiny_pairs / "ds", tmp_path / "images", lambda x: policy.decode(x))

    def cfg(**extra):
        return load_config("digits_sft.yaml", tiny_train_overrides(tiny_digits_dir, **{
            "data.dataset": str(tmp_path / "images"), "offline.batch_groups": 8, "offline.epochs": 2,
            "offline.eval_every": 100, "train.ema": "true", "train.lora_rank": 0, "train.lr": 1e-3,
            "data.eval_prompts": "[a handwritten digit 1]", **extra}))

    train(cfg(), tmp_path / "full")  # 60 images, 16 per step: 3 steps per epoch, 6 steps
    train(cfg(**{"offline.max_steps": 1}), tmp_path / "part")
    train(cfg(), tmp_path / "part", resume=True)
    for group in ("trainable", "ema"):
        a, b = (load_file(str(list_checkpoints(r / "checkpoints")[-1] / f"{group}.safetensors"))
                for r in (tmp_path / "full", tmp_path / "part"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), group


@pytest.mark.parametrize("recipe,loss", [("sd3_group_pickscore.yaml", "sft"), ("flux_group_pickscore.yaml", "dpo_offline")])
def test_diffusers_models_train_on_image_datasets(recipe, loss, tmp_path):
    """SD3 / FLUX (tiny random models, --smoke): images encoded by their VAE (decode's inverse) train sft and
    dpo_offline; --smoke makes the images or pairs from its tiny generated dataset."""
    from flowrl.smoke import smoke_run

    summary = smoke_run(recipe, str(tmp_path / "run"), ["train.mode=offline", f"train.loss={loss}"])
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    key = "fm_loss" if loss == "sft" else "dpo_loss"
    assert summary["steps_done"] >= 1 and all(math.isfinite(r[key]) for r in recs if key in r)
