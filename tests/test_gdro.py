"""GDRO (docs/algorithms.md §8): the loss's math, its gradient direction, and the offline trainer's mechanics."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_train_overrides
from flowrl.losses.gdro import (dpo_loss, gdro_loss, group_velocity_errors, implicit_rewards, plackett_luce_terms,
                                ranking_stats)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "digits_gdro.yaml"


def _distinct_rewards(g, k, gen):
    return torch.stack([torch.randperm(k, generator=gen).float() / k for _ in range(g)])  # [G, k], no ties


def _naive_gdro(s, r, tau):
    """docs/algorithms.md §8 literally, with python loops: sort by reward, sum_{i<k} [lse_{m>=i} s_m - sum_{j>=i} q_i(j) s_j]."""
    total = 0.0
    for sg, rg in zip(s.tolist(), r.tolist()):
        pairs = sorted(zip(rg, sg), key=lambda p: -p[0])
        rs, ss = [p[0] for p in pairs], [p[1] for p in pairs]
        for i in range(len(ss) - 1):
            lse = math.log(sum(math.exp(x) for x in ss[i:]))
            w = [math.exp((x - max(rs[i:])) / tau) for x in rs[i:]]
            q = [x / sum(w) for x in w]
            total += lse - sum(qi * si for qi, si in zip(q, ss[i:]))
    return total / len(s)


# ---------------------------------------------------------------- the loss
def test_matches_the_formula():
    gen = torch.Generator().manual_seed(0)
    s, r = torch.randn(5, 6, generator=gen), torch.rand(5, 6, generator=gen)
    for tau in (0.05, 0.5, 3.0):
        assert gdro_loss(s, r, tau).item() == pytest.approx(_naive_gdro(s, r, tau), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("tau", [0.0, 1e-4, 1e-3])
def test_k2_small_tau_is_diffusion_dpo(tau):
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(64, 2, generator=gen) * 3  # [G, 2]
    r = _distinct_rewards(64, 2, gen)  # winners differ by >= 0.5, so q is one-hot to float32 precision
    win = r.argmax(1)
    s_w, s_l = s.gather(1, win.view(-1, 1)).squeeze(1), s.gather(1, (1 - win).view(-1, 1)).squeeze(1)
    assert torch.allclose(gdro_loss(s, r, tau), dpo_loss(s_w, s_l), atol=1e-6)
    # and per group: the single term is -log sigmoid(s_w - s_l)
    terms = plackett_luce_terms(s, r, tau)  # [G, 2]
    assert torch.allclose(terms[:, 0], -torch.nn.functional.logsigmoid(s_w - s_l), atol=1e-6)
    assert torch.all(terms[:, 1] == 0)


def test_tau_to_zero_converges_to_hard_ranking():
    gen = torch.Generator().manual_seed(2)
    s, r = torch.randn(8, 6, generator=gen), _distinct_rewards(8, 6, gen)
    hard = gdro_loss(s, r, 0.0)
    assert abs(gdro_loss(s, r, 1e-3) - hard) < 1e-5
    assert abs(gdro_loss(s, r, 10.0) - hard) > 1e-2


def test_invariant_to_order_inside_a_group():
    gen = torch.Generator().manual_seed(3)
    s, r = torch.randn(16, 6, generator=gen), torch.rand(16, 6, generator=gen)
    r[:4, :3] = 0.5  # ties too: they are ordered by the implicit reward, not by position
    for tau in (0.0, 0.05, 1.0):
        ref = gdro_loss(s, r, tau)
        for _ in range(5):
            perm = torch.stack([torch.randperm(6, generator=gen) for _ in range(16)])  # [G, k]
            assert torch.allclose(gdro_loss(s.gather(1, perm), r.gather(1, perm), tau), ref, atol=1e-6)
        # and to the order of the groups (it is a mean over groups)
        gp = torch.randperm(16, generator=gen)
        assert torch.allclose(gdro_loss(s[gp], r[gp], tau), ref, atol=1e-6)


def test_gradient_pushes_the_better_sample_up():
    gen = torch.Generator().manual_seed(4)
    s = torch.zeros(32, 6).normal_(generator=gen).requires_grad_(True)
    r = _distinct_rewards(32, 6, gen)
    gdro_loss(s, r, 0.05).backward()
    best, worst = r.argmax(1), r.argmin(1)
    assert torch.all(s.grad.gather(1, best.view(-1, 1)) < 0)  # descent raises the top implicit reward
    assert torch.all(s.grad.gather(1, worst.view(-1, 1)) > 0)  # and lowers the bottom one
    assert torch.allclose(s.grad.sum(1), torch.zeros(32), atol=1e-6)  # shift-invariant in s


def test_dpo_gradient_direction_and_value():
    s_w, s_l = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    loss = dpo_loss(s_w, s_l)
    assert loss.item() == pytest.approx(math.log(2))
    loss.backward()
    assert torch.all(s_w.grad < 0) and torch.all(s_l.grad > 0)


def test_bad_inputs_say_what_to_fix():
    s = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        gdro_loss(s, torch.zeros(2, 4), 0.1)
    with pytest.raises(ValueError, match="k >= 2"):
        gdro_loss(torch.zeros(2, 1), torch.zeros(2, 1), 0.1)
    with pytest.raises(ValueError, match="tau must be >= 0"):
        gdro_loss(s, torch.rand(2, 3), -1.0)
    with pytest.raises(ValueError, match="non-finite"):
        gdro_loss(s, torch.tensor([[0.0, float("nan"), 1.0], [0.0, 1.0, 2.0]]), 0.1)


def test_ranking_stats():
    s = torch.tensor([[3.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    r = torch.tensor([[1.0, 0.0, 0.5], [1.0, 0.5, 0.0]])
    st = ranking_stats(s, r)
    assert st["top1_accuracy"] == 0.5 and st["margin"] == pytest.approx((2 + (-2)) / 2)


# ---------------------------------------------------------------- implicit rewards through a model
def test_implicit_rewards_from_a_lora_policy(tiny_digits_policy):
    from flowrl.trainable import Reference, add_lora

    pol = tiny_digits_policy
    add_lora(pol.transformer, 4, 8.0, pol.lora_target_modules)
    ref = Reference(pol.transformer, need=True)
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(3, 4, 1, 16, 16, generator=gen)  # [G, k, C, H, W]
    t, eps = torch.rand(3, generator=gen) * 0.9 + 0.05, torch.randn(3, 1, 16, 16, generator=gen)
    cond = pol.encode_prompts(["a handwritten digit 1", "a handwritten digit 2", "a handwritten digit 3"])
    err, err_ref = group_velocity_errors(pol, lambda: ref.active(pol), x0, cond, t, eps)
    assert err.shape == err_ref.shape == (3, 4) and err.dtype == torch.float32
    assert torch.allclose(implicit_rewards(err, err_ref, 12.0), torch.zeros(3, 4), atol=1e-6)  # LoRA B = 0
    # one image evaluated alone at the same (t, eps) gives the same error: the group shares (t, eps)
    x_t = (1 - t[1]) * x0[1, 2] + t[1] * eps[1]
    v = pol.velocity(x_t[None], t[1:2], {k: v[1:2] for k, v in cond.items()})
    assert torch.allclose(err[1, 2], ((eps[1] - x0[1, 2] - v[0]) ** 2).mean(), atol=1e-5)
    with pytest.raises(ValueError, match="shared by the group|needs t of shape"):
        group_velocity_errors(pol, None, x0, cond, t[:2], eps)


def _lora_setup(policy, g, k, seed):
    from flowrl.trainable import Reference, add_lora

    torch.manual_seed(0)
    add_lora(policy.transformer, 4, 8.0, policy.lora_target_modules)
    ref = Reference(policy.transformer, need=True)
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(g, k, 1, 16, 16, generator=gen)  # [G, k, C, H, W]
    t, eps = torch.full((g,), 0.5), torch.randn(g, 1, 16, 16, generator=gen)
    cond = policy.encode_prompts([f"a handwritten digit {d}" for d in range(g)])

    def s_now():  # [G, k] implicit rewards at the fixed (t, eps)
        err, err_ref = group_velocity_errors(policy, lambda: ref.active(policy), x0, cond, t, eps)
        return implicit_rewards(err, err_ref, 12.0)

    params = [p for p in policy.transformer.parameters() if p.requires_grad]
    return s_now, torch.optim.SGD(params, lr=0.02)


def _sgd_steps(s_now, opt, r, steps=3):
    """``steps`` SGD steps on the GDRO loss (tau 0.05) -> the implicit rewards after them."""
    for _ in range(steps):
        opt.zero_grad()
        gdro_loss(s_now(), r, 0.05).backward()
        opt.step()
    with torch.no_grad():
        return s_now()


def test_group_errors_on_video_latents():
    """``x0`` [G, k, C, F, H, W] (video latents): the time broadcast and the per-image means cover the
    frame axis; each error equals one video's flow-matching error computed by hand."""
    class Linear:  # velocity = w * x (a stand-in policy; works on any latent rank)
        w = torch.tensor(0.3, requires_grad=True)

        def velocity(self, x, sigma, cond):
            return self.w * x

    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 3, 4, 2, 4, 4, generator=gen)  # [G, k, C, F, H, W]
    t, eps = torch.tensor([0.3, 0.7]), torch.randn(2, 4, 2, 4, 4, generator=gen)
    pol = Linear()
    err, err_ref = group_velocity_errors(pol, None, x0, {}, t, eps)
    assert err.shape == (2, 3)
    x_t = (1 - t[1]) * x0[1, 2] + t[1] * eps[1]
    torch.testing.assert_close(err[1, 2], ((eps[1] - x0[1, 2] - 0.3 * x_t) ** 2).mean())
    gdro_loss(implicit_rewards(err, err_ref, 2.0), torch.randn(2, 3, generator=gen), 1.0).backward()
    assert pol.w.grad is not None and torch.isfinite(pol.w.grad)


def test_steps_through_the_network_raise_the_winners_implicit_reward(tiny_digits_policy):
    """k = 2 (the DPO case): a few SGD steps on a LoRA policy raise s_w - s_l from 0."""
    s_now, opt = _lora_setup(tiny_digits_policy, 1, 2, seed=6)
    r = torch.tensor([[0.2, 0.9]])  # sample 1 wins
    s = _sgd_steps(s_now, opt, r)
    assert s[0, 1] > 0 > s[0, 0]  # the winner fits better than the reference, the loser worse


def test_steps_through_the_network_lower_the_group_loss(tiny_digits_policy):
    s_now, opt = _lora_setup(tiny_digits_policy, 2, 4, seed=7)
    r = torch.tensor([[0.1, 0.7, 0.3, 0.9], [0.5, 0.2, 0.8, 0.0]])
    with torch.no_grad():
        l0 = gdro_loss(s_now(), r, 0.05)
    s = _sgd_steps(s_now, opt, r)
    assert gdro_loss(s, r, 0.05) < l0
    assert ranking_stats(s, r)["margin"] > 0  # best above worst, on average over the groups


# ---------------------------------------------------------------- the offline trainer
def _offline_cfg(model_dir, dataset, **extra):
    from flowrl.trainers.config import load_config

    ov = {"offline.dataset": str(dataset), "offline.groups_per_prompt": 2, "offline.groups_per_shard": 6,
          "offline.k": 3, "offline.num_steps": 3, "offline.batch_groups": 5, "offline.eval_every": 2,
          "offline.epochs": 2, "train.lr": 1e-2, "train.grad_accum": 2, "train.lora_rank": 4,
          "reward.weights": "{jpeg_compressibility: 1.0}",  # a reward with nothing to train first: fast
          "data.eval_prompts": "[a handwritten digit 1, a handwritten digit 2]"}
    ov.update(extra)
    over = tiny_train_overrides(model_dir, **ov)
    return load_config(RECIPE, over)


@pytest.fixture(scope="module")
def tiny_dataset(tiny_digits_dir, tmp_path_factory):
    from flowrl.trainers.offline import generate_offline

    ds = tmp_path_factory.mktemp("gdro") / "ds"
    summary = generate_offline(_offline_cfg(tiny_digits_dir, ds), progress=False)
    assert summary["groups"] == 20 and summary["rewards"] == ["jpeg_compressibility"]
    return ds


def _weights(run):
    from safetensors.torch import load_file

    from flowrl.checkpoints.common import list_checkpoints

    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "trainable.safetensors"))


@pytest.fixture(scope="module")
def full_run(tiny_digits_dir, tiny_dataset, tmp_path_factory):
    from flowrl.trainers.offline import train

    run = tmp_path_factory.mktemp("gdro-run") / "full"
    return run, train(_offline_cfg(tiny_digits_dir, tiny_dataset), run)


def test_offline_training_runs_logs_and_checkpoints(full_run):
    run, summary = full_run
    # 20 groups, 5 per pass x 2 passes per step -> 2 steps per epoch, 2 epochs
    assert summary["steps_per_epoch"] == 2 and summary["steps_done"] == 4 and summary["epochs_done"] == 2
    assert summary["generation_seconds"] > 0 and summary["compute_seconds"] > summary["train_seconds"] > 0
    w = _weights(run)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in w.items())
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "pl_loss" in r]
    assert [r["iteration"] for r in steps] == list(range(4))
    for r in steps:
        assert all(k in r for k in ("loss", "fm_top", "top1_accuracy", "margin", "grad_norm", "ranked_fraction",
                                    "step_seconds", "train_seconds", "epoch"))
        assert math.isfinite(r["loss"])
    assert [r["iteration"] for r in recs if "eval/reward" in r] == [0, 2, 4]
    for f in ("reward_curve.png", "before_after.png", "summary.json", "config.yaml"):
        assert (run / f).exists(), f


def test_offline_exact_resume(tiny_digits_dir, tiny_dataset, full_run, tmp_path):
    from flowrl.trainers.offline import train

    full, part = full_run[0], tmp_path / "part"
    train(_offline_cfg(tiny_digits_dir, tiny_dataset, **{"offline.max_steps": 1, "offline.eval_every": 5}), part)
    train(_offline_cfg(tiny_digits_dir, tiny_dataset), part, resume=True)  # steps 1-3, crossing into epoch 2
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    its = [json.loads(l)["iteration"] for l in (part / "metrics.jsonl").read_text().splitlines() if "pl_loss" in l]
    assert its == list(range(4))


def test_offline_config_errors_name_the_fix(tiny_digits_dir, tiny_dataset, tmp_path):
    from flowrl.data.offline_store import DatasetError
    from flowrl.errors import ConfigError
    from flowrl.trainers.offline import OfflineTrainer

    with pytest.raises(ConfigError, match="generate-offline"):
        OfflineTrainer(_offline_cfg(tiny_digits_dir, tiny_dataset, **{"offline.dataset": "null"}), tmp_path / "a")
    with pytest.raises(DatasetError, match="generate-offline"):
        OfflineTrainer(_offline_cfg(tiny_digits_dir, tmp_path / "none"), tmp_path / "b").setup()
    with pytest.raises(DatasetError, match="rescore-offline"):
        OfflineTrainer(_offline_cfg(tiny_digits_dir, tiny_dataset, **{"reward.weights": "{digits: 1}"}),
                       tmp_path / "c").setup()
    with pytest.raises(ConfigError, match="fewer than one optimizer step"):
        OfflineTrainer(_offline_cfg(tiny_digits_dir, tiny_dataset, **{"offline.batch_groups": 11}),
                       tmp_path / "d").setup()
    with pytest.raises(ConfigError, match="offline.k"):
        _offline_cfg(tiny_digits_dir, tiny_dataset, **{"offline.k": 1})
    with pytest.raises(ConfigError, match="offline.sampler"):
        _offline_cfg(tiny_digits_dir, tiny_dataset, **{"offline.sampler": "sde"})
    with pytest.raises(ConfigError, match="train.mode"):
        _offline_cfg(tiny_digits_dir, tiny_dataset, **{"train.mode": "offlin"})


def test_corrected_score():
    from flowrl.trainers.offline import corrected_score

    r = torch.tensor([1.0, 1.0, 0.5])
    q = torch.tensor([1.0, 0.5, 0.0])  # u = 5, 3, 1 on the paper's 1-5 scale
    assert torch.allclose(corrected_score(r, q, [1, 5]), torch.tensor([2.2, 0.2, -0.8]))


def test_every_gdro_recipe_loads():
    from flowrl.trainers.config import load_config

    for name, mode in (("digits_gdro.yaml", "offline"), ("flux_gdro_ocr.yaml", "offline"), ("sd3_gdro_ocr.yaml", "offline")):
        cfg = load_config(ROOT / "recipes" / name)
        assert cfg.train.mode == mode and cfg.train.loss == "offline_gdro"
    for name in ("flux_gdro_ocr.yaml", "sd3_gdro_ocr.yaml"):
        cfg = load_config(ROOT / "recipes" / name)
        o = cfg.effective_loss_options()
        assert (cfg.offline.k, o["tau"], o["beta"], o["gamma"]) == (6, 0.05, 12.0, 0.5), name  # the paper's OCR settings


def test_cli_generate_train_rescore(tiny_digits_dir, tmp_path, capsys):
    """``flowrl generate-offline`` / ``train`` (offline mode) / ``rescore-offline`` end to end (in process)."""
    from flowrl.cli import main

    ds, run = tmp_path / "ds", tmp_path / "run"
    ov = tiny_train_overrides(tiny_digits_dir, **{"offline.groups_per_prompt": 1, "offline.k": 2,
                                                  "offline.num_steps": 2, "offline.batch_groups": 5,
                                                  "train.grad_accum": 1, "offline.epochs": 1,
                                                  "offline.eval_every": 5,
                                                  "reward.weights": "{jpeg_compressibility: 1.0}"})
    assert main(["generate-offline", "--config", str(RECIPE), "--out", str(ds), *ov]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == 10
    assert main(["train", "--config", str(RECIPE), "--output-dir", str(run), f"offline.dataset={ds}", *ov]) == 0
    assert json.loads((run / "summary.json").read_text())["steps_done"] == 2
    capsys.readouterr()
    assert main(["rescore-offline", "--dataset", str(ds), "--reward", "jpeg_incompressibility"]) == 0
    assert json.loads(capsys.readouterr().out)["column"] == "reward/jpeg_incompressibility"
    code = main(["train", "--config", str(RECIPE), "--output-dir", str(tmp_path / "run2"),
                 f"offline.dataset={tmp_path / 'nope'}", *ov])
    err = capsys.readouterr().err
    assert code == 2 and "generate-offline" in err and "Traceback" not in err
    assert not (tmp_path / "run2" / "config.yaml").exists()  # a failed start claims no run dir


def test_bench_offline_smoke(tiny_digits_dir, tmp_path):
    """``bench_offline`` runs both methods in one call and reports reward vs total compute."""
    from flowrl.bench.offline import bench_offline, table

    common = tiny_train_overrides(tiny_digits_dir, **{"reward.weights": "{jpeg_compressibility: 1.0}",
                                                      "data.eval_prompts": "[a handwritten digit 3]"})
    off = common + ["offline.groups_per_prompt=1", "offline.k=2", "offline.num_steps=2", "offline.batch_groups=5",
                    "train.grad_accum=1", "offline.epochs=1", "offline.eval_steps=4"]
    on = common + ["train.batch_size=8"]
    out = bench_offline(str(RECIPE), str(ROOT / "recipes" / "digits.yaml"), budget_seconds=1.0, eval_every_seconds=0.5,
                        offline_overrides=off, online_overrides=on, json_path=str(tmp_path / "b.json"),
                        png_path=str(tmp_path / "b.png"), workdir=str(tmp_path / "w"), progress=False)
    assert (tmp_path / "b.png").exists() and json.loads((tmp_path / "b.json").read_text())["budget_seconds"] == 1.0
    off_c, on_c = out["offline"]["curve"], out["online"]["curve"]
    assert off_c[0]["compute_seconds"] == 0 and off_c[1]["compute_seconds"] == out["offline"]["generation_seconds"] > 0
    assert off_c[0]["eval_reward"] == on_c[0]["eval_reward"]  # same base, same evaluation set
    assert out["offline"]["compute_seconds"] == pytest.approx(out["offline"]["generation_seconds"]
                                                              + out["offline"]["train_seconds"])
    assert out["online"]["iterations"] >= 1 and "offline" in table(out)


def test_generate_offline_with_text_cache_writes_the_same_dataset(tiny_digits_dir, tiny_dataset, tmp_path):
    """``model.text_embedding_cache`` during generation: the cache is written, the latents are unchanged."""
    from flowrl.data.offline_store import OfflineDataset
    from flowrl.trainers.offline import generate_offline

    ds = tmp_path / "ds"
    generate_offline(_offline_cfg(tiny_digits_dir, ds, **{"model.text_embedding_cache": str(tmp_path / "emb"),
                                                          "model.drop_text_encoders": "true"}), progress=False)
    assert (tmp_path / "emb" / "index.json").exists()
    a, b = OfflineDataset(tiny_dataset), OfflineDataset(ds)
    ga = a.read(torch.arange(len(a)), rewards=["jpeg_compressibility"])
    gb = b.read(torch.arange(len(b)), rewards=["jpeg_compressibility"])
    assert ga.prompts == gb.prompts and torch.equal(ga.x0, gb.x0)
    a.close(), b.close()
